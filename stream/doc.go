// Package stream moves labelled records from Kafka into cfguard and events back out.
//
// A Schema, built from a model's feature and class names, decodes and validates one JSON
// record (schema.go says what a record is, scanner.go reads it). A Consumer reads every
// partition of a topic and groups the good records into increments; records that fail
// validation go to a dead-letter topic, with the reason in a header, before the increment that
// covers them is handed out.
//
// # Offsets: the checkpoint is the truth
//
// The daemon checkpoints each increment's NextOffsets in its ledger together with the
// increment's effect, in one transaction. Those checkpointed offsets are where reading
// resumes: NewConsumer reads each partition from ConsumerConfig.Resume (the earliest offset
// where the checkpoint has none), so no record is applied twice and none is skipped:
//
//	applied(p) = [0, next[p])   never fetched again
//	             [next[p], ...) fetched, decoded into increments
//
// The Consumer is not a member of a consumer group, so a restart, even right after a crash,
// reads again at once: there is no session to expire and no rebalance to wait for. It still
// commits offsets to kafka.group_id as a simple consumer (OffsetCommit with generation -1 and
// no member id, which Kafka and kfake store for a group without members) once the daemon says
// an increment is durable (MarkDurable): in the background, coalesced to at most one commit
// per CommitInterval, retried until they succeed. Those commits are informational, so that
// Kafka tooling (consumer-group describe) shows the daemon's lag; nothing reads them back.
//
// # One writer per posterior
//
// Only one daemon may apply records to one posterior. The ledger guarantees it: it holds an
// exclusive lock on the state directory's database file for as long as it is open, so a second
// daemon on the same state directory fails at Open. Two daemons with different state
// directories keep two posteriors and may read the same topic; each needs its own
// kafka.group_id, since a group with members, or another daemon's commits, would make the
// group's offsets meaningless (a group with active members refuses the commits outright).
//
// # Increments
//
// While the consumer keeps up, an increment holds MaxRecords good records, or fewer once
// MaxWait has passed since its first record arrived. When more are already fetched and
// decoded, the consumer is behind and the increment takes them, up to MaxRecordsBacklog: fewer,
// larger updates catch up faster. Under the daemon's default solver (update.SolverConverge) an
// update uses every record of its increment and moves the posterior as far as their evidence
// says, so a larger increment's update KL is larger; under update.SolverAdam an update costs a
// fixed number of iterations on minibatches and its KL is bounded by the learning rate times the
// iterations, whatever the increment's size.
// The next increment is fetched, decoded and dead-lettered in the background (up to
// 2 x MaxRecordsBacklog records ahead, plus one fetch) while the current one is applied.
//
// # Retention and gaps
//
// When a partition's next offset is below its log start offset (the broker deleted records by
// retention before they were read, e.g. while the daemon was down), the consumer does not jump
// silently: it logs an ERROR with the range, reports it as a Gap in the next increment (which
// the daemon checkpoints) and in Stats.Lost, and reads on from the log start.
//
// # Topic identity
//
// A partition whose log no longer holds the consumer's position (the topic was deleted and
// recreated, or the broker lost records) stops the consumer with a TopicResetError naming the
// topic, the partition and the offsets, rather than skipping the new log's records below the
// position in silence. It is found when a fetch is refused because the position is past the
// partition's end, and, while the consumer runs, by checking after every pause (a failed or
// empty fetch, a wait for room, the topic missing from the metadata) that the partition still
// holds the record read last before handing out what came next. A topic recreated while
// the consumer was not running and written past the checkpointed offset cannot be told from
// the old one by offsets alone (Kafka's topic ids would tell, and kafka-go does not expose
// them): each Increment therefore carries a RecordMark per partition (the offset, timestamp
// and key/value hash of a record read before its NextOffsets), which the daemon checkpoints
// with the offsets, and a consumer started with ConsumerConfig.ResumeMarks first fetches the
// marked record of each partition and compares. A marked record that retention or compaction
// removed cannot be compared and is no reset: the check is skipped with an INFO line, and so
// it is for a partition without a mark. ConsumerConfig.AcceptTopicReset is the operator's
// confirmation: the partition is then read from its log start.
//
// # Readiness and outages
//
// Health tells whether the consumer works, from state its own traffic keeps current (see
// Consumer.Health for the bounds). Broker errors are retried with exponential backoff and
// jitter; an outage writes one WARN line when it starts and one INFO line when it ends, with
// its duration, the failed attempts and the log lines suppressed (kafka-go's own error lines
// included).
//
// A Publisher writes JSON events. Ping is a one-off reachability check. ConnConfig carries the
// connection options (brokers, TLS, SASL PLAIN / SCRAM-SHA-256 / SCRAM-SHA-512, client id)
// shared by all of them; LoadTLS builds its TLS configuration from files.
package stream
