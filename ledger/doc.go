// Package ledger is cfguard's durable state and the re-certification of stored counterfactuals.
//
// Everything lives in one bbolt file, <state_dir>/cfguard.db: the current posterior, the anchor
// posteriors that stored counterfactuals (CEs) were certified under, the CEs, the consumed Kafka
// offsets, counters and a bounded KL history. Each change is one bbolt transaction, fsynced on
// commit, so a crash leaves either the state before a checkpoint or the state after it.
//
// # Anchors, not sums
//
// A CE's certificate (p1, V1) was measured under its anchor posterior q_a. After any number of
// updates its bounds use the KL from that anchor directly,
//
//	p_now >= p1 - 2 sqrt(KL(q_now || q_a) / 2)        (Theorem 1)
//	V_now <= V1 + 6 sqrt(KL(q_now || q_a) / 2)        (Theorem 2)
//
// never a sum of per-step KLs (KL is not a metric). So an anchor posterior is kept as long as one
// CE refers to it (reference counted) and released afterwards; the current posterior is always
// kept. Judging (constants, variance budget, Hoeffding p1) is certify.Policy.
//
// # Re-certification at scale
//
// Recertify computes KL(q_now || q_a) once per live anchor, then walks the CEs' 64-byte headers
// (bucket ce_hdr: status, anchor, p1, V1, delta, eps, samples) doing arithmetic in place; the
// vectors and history live in a separate bucket (ce_body) read only for CEs whose bound fails,
// which get one batched Monte-Carlo pass. Bound, VarBound and KLFromAnchor are not stored per CE
// but derived on read from the anchor's stored KL, so a step that changes no status writes
// nothing per CE.
//
// # Atomicity with the consumer
//
// The daemon's increment is: update -> Recertify(q_new) -> Checkpoint{Model: q_new,
// Recertified, Changes, Offsets, ...} -> commit Kafka offsets. Checkpoint refuses a report made
// before CEs were registered or changed (ErrStale); Commit does both steps under the writer lock.
package ledger
