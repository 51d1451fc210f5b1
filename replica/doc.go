// Package replica is a daemon's part in a replicated deployment (replication.enabled): the
// follower of the posterior log (package postlog) and the updater that appends to it.
//
// The follower plays the log through its acceptance rule and applies each accepted entry:
// a new term or epoch as a checkpoint of the log's head, an increment as the daemon's commit
// of the recorded last layer, checked against the entry's hash, never computed again. The
// replica whose member of the consumer group <kafka.group_id>.updater is assigned the log's
// partition is the updater: it claims a term, forms increments from kafka.topic where the
// log's head covers, has the daemon compute each, appends it, and trusts it only once its own
// follower has read it back as accepted.
//
// The package sits beside postlog and ceshare, not under daemon: it is a domain of its own
// (who writes the log, what counts), and it reaches the daemon only through two small
// interfaces the daemon hands to New:
//
//	Host    Current, SetCurrent, InitialModel, Consumer, Compute, Commit, Checkpoint, DeadLettered,
//	        TopicReset
//	Ledger  LogHead, Current, Checkpoint, Path (the daemon's *ledger.Ledger)
//
// Data flows one way: package daemon imports replica, never the reverse. A single daemon
// (replication.enabled: false) never builds a Replica, and its ingest does not pass through
// here.
//
// Files: replica.go (the Replica, its health and status), join.go (joining a log, or starting
// one with its genesis), follow.go (the follower: reading, judging and applying entries),
// past.go (earlier posteriors, for CEs measured under them), reset.go (a log that ends before
// what was read: a reset topic), updater.go (the updater group, terms and increments),
// settings.go (the cluster-wide settings), balancer.go (the updater group's assignment),
// peer.go (the transport toward the other replicas' APIs).
//
// Invariants:
//
//   - The ledger stores the head of the chain the follower accepted (ledger.Checkpoint's
//     LogHead) in the same transaction as what the entry changed: a restart resumes after the
//     last entry applied, and Join refuses a log that no longer holds it (a reset topic) or
//     that does not authenticate under replication.key_file.
//   - Only the follower applies: the updater's own entries reach the ledger as everyone's do,
//     once read back and accepted; an entry that loses to another writer's is dropped and the
//     updater steps down (errLost).
//   - An entry the follower cannot apply (an unknown format, a posterior that does not hash to
//     its entry) stops following; the replica keeps serving the last verified posterior, and
//     Health says why until a new epoch moves the log past the entry.
//   - An increment whose coverage lies past the input topic's ends is refused (postlog.PastEnd)
//     by every replica alike.
//   - A replica whose cluster-wide settings (ClusterSettings) differ from the genesis's does
//     not join (*SettingsError, Refuse): it applies nothing and writes nothing.
//
// Every goroutine started here stops when its context ends.
package replica
