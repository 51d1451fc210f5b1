// Package daemon is cfguard's long-running sidecar: it wires the stream of labelled records,
// last-layer updates, the closed-form KL, re-certification of stored counterfactuals, durable
// state, metrics, events, scheduled audits and the HTTP API into one lifecycle.
//
// Data flows one way, one increment at a time:
//
//	Kafka topic --stream.Consumer--> increment --update.LastLayer--> candidate posterior
//	  --certify.KL vs budget--> policy (alert | reject | clip)
//	  --ledger.Commit (re-certify every CE by its anchor KL by the bounds only, checkpoint offsets,
//	    write the increment's events to the outbox; one fsynced tx, under d.mu)-->
//	  metrics --> consumer.MarkDurable (informational group offset commit)
//
// Beside it, three background components, none holding d.mu:
//
//	outbox publisher  ledger outbox --> events topic, in order, at least once (outbox.go)
//	confirmer         CEs whose bound failed --ledger.Confirm, batches--> Monte-Carlo verdicts (confirm.go)
//	audits            every CE --ledger.Audit, batches--> re-anchored or judged (audit.go)
//
// The checkpoint's offsets are the truth: the consumer reads each partition from them at start
// (see package stream); group offsets are committed after the checkpoint, asynchronously, only
// for Kafka tooling. A checkpoint the disk refuses (ledger.ErrWrite) holds the increment and is
// retried with backoff while /readyz reports it (degraded.go); nothing is lost or applied twice.
// Any other commit the disk refuses (a registration, a deletion, a verdict batch) is reported by
// /readyz for a minute (ledgerHealth).
//
// With replication.enabled, package replica takes ingest's place: its follower applies the
// posterior log's entries and its updater appends increments, both through replicaHost
// (replication.go), the daemon's compute and commitStep above; the CE share is package cluster,
// which reaches the daemon through shareHost (replication.go) only.
//
// The HTTP API: api.go (routes, authentication), apibody.go (strict request bodies, error
// answers), apices.go (registering, reading, listing, deleting, explaining and auditing CEs),
// apimodel.go (the posterior and predictions).
//
// Run starts everything and returns when ctx is cancelled (nil) or a component fails (its error).
// main handles signals; nothing here calls os.Exit.
package daemon
