// Package stream moves labelled records from Kafka into cfguard and events back out.
//
// A Schema, built from a model's feature and class names, decodes and validates one JSON
// record. A Consumer reads a topic as a member of a consumer group and groups the good records
// into increments (at most MaxRecords records, at most MaxWait after the first message);
// records that fail validation go to a dead-letter topic, with the reason in a header, before
// their offsets can be committed. Offsets are committed only by Consumer.Commit, which the
// daemon calls after the increment's effect is durable (checkpointed). After a crash the
// checkpoint is the truth: Consumer.Resume drops the messages below the checkpointed next
// offset of each partition, so no record is applied twice and none is skipped:
//
//	applied(p) = [0, next[p])   delivered again after a crash => skipped, committed
//	             [next[p], ...) decoded into increments
//
// A Publisher writes JSON events. Ping is a readiness check. ConnConfig carries the
// connection options (brokers, TLS, SASL PLAIN / SCRAM-SHA-256 / SCRAM-SHA-512, client id)
// shared by all of them.
package stream
