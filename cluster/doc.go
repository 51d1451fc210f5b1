// Package cluster is a replica's share of the counterfactuals (CEs): it joins the CE group
// (package ceshare), applies the registrations and deletions of the partitions the group gives
// it to the replica's ledger in partition order (Share.Apply), and answers for the cluster:
//
//   - a registration or a deletion accepted here is sent to the CE topic (Share.Send,
//     Share.Forget) and answered with the outcome its owner recorded (Share.AwaitOutcome);
//   - a read, a list or an audit is answered by the owners of the CEs it covers, this replica's
//     ledger for its own partitions and the others' APIs for theirs (Share.Find, Share.List,
//     Share.Audit, AskAll), with the peer protocol's headers (HeaderForwarded and others);
//   - the CE states of its ledger go to the CE state topic (States), from which a later owner of
//     a partition restores its CEs' renewals, verdicts and history.
//
// A partition this replica was given is rebuilding until its requests were replayed to the
// partition's end (ceshare.Member.Ready): a read of an id the ledger does not hold there is not a
// 404 but ErrRebuilding (Local), and so is a list while any is (HoldsWhole; NotCaughtUp names
// them); an audit waits until none is, no release runs and the member has settled after a start
// or a pause of the process past its session (CaughtUp, ceshare.Member.Settled).
//
// A Share reaches the daemon it runs in through Host only: the posterior it serves, a lock
// against posterior commits, retried ledger writes and measurements. docs/DESIGN.md describes
// the design; docs/REPLICAS.md, how to run replicas.
package cluster
