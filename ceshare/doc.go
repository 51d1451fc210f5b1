// Package ceshare shares the stored counterfactuals (CEs) out to the replicas of cfguard
// through Kafka: the CE topic holds registration and deletion requests keyed by CE id, and
// its partitions are owned by the members of a consumer group, one member per partition.
//
// # Requests and partitions
//
// Any replica accepts a registration or a deletion and appends it as a Request with a
// Producer, to partition Partition(id, P): murmur2 of the id, as Kafka's Java partitioner and
// kafka-go's Murmur2Balancer compute it, so that external tools find a CE's partition too.
// The topic keeps its requests for ever (NewMember creates it so): a new owner of a partition
// rebuilds its share from them.
//
// # Ownership
//
// A Member joins the group <kafka.group_id>.ce. In each generation it calls Hooks.Acquire for
// every partition the group assigns it (the daemon answers with the offset its ledger stored
// for the partition, 0 when it has none), then reads each partition from there and hands its
// requests to Hooks.Apply in batches, with the offset after them (the daemon stores both in
// one transaction). Each request carries a request id (Request.RID) that the daemon applies
// once, so that a producer's retry of a request that landed changes nothing.
//
// Records that do not authenticate are left out, counted and logged, and so are copies (a value
// the cluster signed, under another record's key, in another partition than its id's, or naming
// no id): anyone who can write the topic can make those. A record that authenticates and does
// not decode as a request of this build (a newer build's format), or that MemberConfig.Readable
// refuses, blocks its partition instead (Blocked): nothing at or after it is applied, and the
// store keeps its offset, until a build that reads it owns the partition, or MemberConfig.Skip
// names it; skipping it otherwise would lose what a replica acknowledged.
//
// A partition the next generation gives to another member is released (Hooks.Release), and so is everything when no generation comes within the session timeout
// after the last one ended (the group evicted the member). A member that stops, cleanly or
// not, releases nothing: a member that starts on a store still holding partitions from an
// earlier run (MemberConfig.Held) releases, at its first generation, those that generation
// gives to others.
//
// kafka-go implements only the eager rebalance protocol: every rebalance ends every member's
// generation, and a member rejoins only once the functions its generation started return. So
// each partition's loop stops within one fetch (FetchWait) or one Apply when the generation
// ends. The group balancer is sticky: each member's UserData carries its replica id, its
// advertised URL and the partitions it owned; the leader keeps partitions where they were and
// balances the rest to within one partition, so a rebalance moves only what must move, and a
// member that keeps a partition goes on from its own ledger.
//
// # Finding the owner of a CE
//
// A Directory answers which replica owns a CE, and at which URL, from the group's description
// (DescribeGroups: each member's assignment and UserData), cached briefly.
//
// # States and claims
//
// With MemberConfig.StateTopic, owners also write each CE's state to the compacted CE state
// topic (StateWriter), so that the next owner of a partition rebuilds its CEs with their
// renewals, verdicts and history (Request.State). A member claims each partition it acquires
// afresh there (Claim) before it reads the partition's requests: a state written after the
// claim by a replica the claim does not name (a previous owner paused past its session, or
// its outbox published after a restart) does not replace the CE's state from before it.
//
// # Fencing
//
// Ownership of the requests is not fenced: a member cut off from the coordinator keeps what it
// holds until it notices (its heartbeat fails, or no generation comes within the session
// timeout), while the group may already have given its partitions to others. Each replica
// writes only its own ledger, so two owners of one partition for a moment both apply the same
// requests, each to its own ledger; of what they write to the shared CE state topic, readers
// keep the claimed owner's. Until the cut-off member learns that its generation ended, it also
// answers reads from its own ledger (cluster.Share.Local answers them 503 from then on, until
// the partition is caught up again).
//
// # Files
//
// member.go (the Member, its generations and what it reports), replay.go (reading a partition:
// authenticating and decoding its requests, blocking or skipping, applying them), gaps.go
// (offsets the topic no longer holds, a topic recreated: restoring from states), release.go
// (partitions given to others), state.go and claim.go (the CE state topic), request.go and
// producer.go (requests), directory.go (finding an owner), balancer.go (the sticky assignment),
// partition.go (a CE's partition), topic.go (the topics: creating them, their partitions and
// offsets).
package ceshare
