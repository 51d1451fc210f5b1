// Package daemon is cfguard's long-running sidecar: it wires the stream of labelled records,
// last-layer updates, the closed-form KL, re-certification of stored counterfactuals, durable
// state, metrics, events, scheduled audits and the HTTP API into one lifecycle.
//
// Data flows one way, one increment at a time:
//
//	Kafka topic --stream.Consumer--> increment --update.LastLayer--> candidate posterior
//	  --certify.KL vs budget--> policy (alert | reject | clip)
//	  --ledger.Commit (re-certify every CE by its anchor KL, checkpoint offsets, one fsynced tx)-->
//	  events topic, metrics --> consumer.MarkDurable (informational group offset commit)
//
// The checkpoint's offsets are the truth: the consumer reads each partition from them at start
// (see package stream); group offsets are committed after the checkpoint, asynchronously, only
// for Kafka tooling.
//
// Run starts everything and returns when ctx is cancelled (nil) or a component fails (its error).
// main handles signals; nothing here calls os.Exit.
package daemon
