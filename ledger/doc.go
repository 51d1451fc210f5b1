// Package ledger is cfguard's durable state and the re-certification of stored counterfactuals:
// what the state holds (its buckets and records, schema.go and record.go), and the rules that
// move it (registration, re-certification, renewals and verdicts, audits, the outbox, shares,
// the quarantine of damaged records).
//
// Everything lives in one bbolt file, <state_dir>/cfguard.db: the current posterior, the anchor
// posteriors that stored counterfactuals (CEs) were certified under, the CEs and their indexes,
// the consumed Kafka offsets, counters, a bounded KL history and an event outbox. Each change is
// one bbolt transaction, fsynced on commit, so a crash leaves either the state before a
// checkpoint or the state after it. The file itself (its checks before bbolt opens it, the
// state directory's lock, transactions that survive bbolt's faults and failed commits, the
// checksums that seal every value) is package store's (ledger/store), which knows nothing of
// what the ledger keeps in it.
//
// # Buckets (schema 2)
//
//	meta           schema, current posterior (blob, SHA-256, version), CE generation, status
//	               counts, applied records, KL history and outbox sequence numbers, origin of the
//	               first posterior, fingerprint of the policy the indexes were built for, the
//	               newest update marked as a KL budget breach (kl_breach) and the newest that
//	               failed (kl_failed), each kept after the KL history drops it (a damaged one is
//	               deleted at Open; a missing kl_failed is taken from the history when it holds one);
//	               on replicas, the posterior log's head the posterior is at (log_head) and, per CE
//	               partition owned, the offset after the last request applied (share/<p>) and a
//	               record read before it (sharewitness/<p>; share.go)
//	offsets        partition -> next offset to consume
//	offset_marks   partition -> the offset, Kafka timestamp and key/value hash of a record read
//	               before it (OffsetMark; optional: absent in ledgers written before marks)
//	counters       name -> count
//	ce_hdr         CE id -> 72-byte header: status, Monte-Carlo verdict version, target, anchor,
//	               p1, V1, delta, epsilon, samples, updated-at (see record.go)
//	ce_body        CE id -> x, x', created-at, the last MaxHistory status changes
//	anchors        version -> references, KL(q_now || q_anchor) and the version it was computed at
//	anchor_models  version -> the anchor posterior
//	anchor_kl      per live anchor, what of its KL over the versions committed a lapsed
//	               certificate's lapse version needs: the KL of each version before a lapse and
//	               the least KL of the versions between (optional; lapse.go)
//	kl_history     sequence -> one update: update KL, max anchor KL, outcome
//	requests       request id -> the outcome of a CE-topic request an owner applied, or of a
//	               registration sent with an Idempotency-Key (optional; requests.go)
//	requests_at    applied-at | request id: the outcomes in the order they expire (optional)
//	outbox         sequence -> event key and value, waiting to be published
//	quality        KL history sequence -> the daemon's prequential record of that increment
//	               (optional; quality.go)
//	quarantine     CE id -> a damaged CE's quarantined-at, reason, raw header and body
//	               (optional: made by the first quarantine; quarantine.go)
//	reissue        CE id -> the posterior version of the status change after which it waits for
//	               a reissue (optional: made by the first such change with Options.Reissue;
//	               reissue.go)
//	idx_p1, idx_var, idx_fail   the indexes (below)
//	idx_cert       empty: the certified index of layout v1, kept so that a cfguard that reads that
//	               layout opens the file (and rebuilds its indexes) instead of refusing it
//
// Every value ends in a CRC-32C of its key and payload (store.Seal): bbolt checks its page
// structure and meta pages but not the bytes of values, so without it a damaged byte in a record
// would be read as a different number.
//
// # Anchors, not sums
//
// A CE's certificate (p1, V1) was measured under its anchor posterior q_a. After any number of
// updates its bounds use the KL from that anchor directly,
//
//	p_now >= p1' - 2 sqrt(KL(q_now || q_a) / 2)        (Theorem 1; p1' = p1 or its Hoeffding lower bound)
//	V_now <= V1 + 6 sqrt(KL(q_now || q_a) / 2)         (Theorem 2)
//
// never a sum of update KLs (KL is not a metric). So an anchor posterior is kept as long as one
// CE refers to it (reference counted) and released afterwards. Judging (constants, variance
// ceiling, Hoeffding p1) is certify.Policy. Bound, VarBound, KLFromAnchor and whether the
// certificate has lapsed are derived on read from the anchor's stored KL, so an update that
// changes no status writes nothing per CE, however many certificates it lapses.
//
// # Re-certification that scales with change
//
// With an anchor's KL fixed, whether a CE is certified is a threshold on its p1' (Theorem 1)
// and on its variance headroom ceiling(epsilon) - V1 (Theorem 2). idx_p1 and idx_var keep every
// CE holding a certificate sorted by anchor, class (certified, or at_risk and invalidated) and
// each key, with what judging reads in each entry, so when an update moves an anchor's KL from
// k_old to k_new, Recertify judges only the entries whose keys lie between the two thresholds,
// exactly as a scan of every CE would (index.go), and reads a CE only when its status changes.
// The first certified idx_p1 entry at or above the threshold gives the smallest Theorem 1 bound
// at once. An update that changes no status costs one KL per live anchor, a few index seeks and
// a step over each entry between the thresholds, whatever the number of CEs stored; it writes
// the anchors' KL and the count of lapsed certificates. The indexes depend on the policy (and
// their layout, policyFingerprint): Open rebuilds them, re-judging every CE, when it changes.
//
// # Lapses, renewals and verdicts
//
// Re-certification never samples. Wherever bounds are evaluated anew (re-certification, the
// rebuild at Open, registration, a renewed certificate) the CE moves by one rule,
// certify.Rejudge, and the check at Open holds every stored CE to be a fixed point of it. A
// certified CE whose bound fails at its anchor's stored KL has lapsed: it keeps its status (no
// status change, no event, no write; the lapse is derived, see Ledger.lapsed). Confirm, run by
// the daemon in the background, takes such CEs from the front of their anchor's certified class
// in idx_p1 and idx_var, then at_risk or invalidated ones whose last verdict is older than the
// posterior it samples and does not carry to the current one (below) from idx_fail (sorted by
// the version of their last measurement, none first), samples them without holding the writer
// lock, and writes in one short
// transaction, for each: a renewal (certify.Renewable: re-anchored to the posterior sampled, still
// certified) or a verdict (certify.Verdict: at_risk or invalidated, with hysteresis by evidence).
// If ingestion promoted a newer posterior while the batch was sampled, the results are written
// all the same, as of the posterior sampled: renewals are judged at KL(q_now || q_sampled) (that
// posterior's snapshot stored as their anchor), so measurement keeps up with any rate of updates
// instead of being discarded. A CE whose bound holds again is certified by the bound, whatever
// its last verdict.
//
// # Verdicts carry
//
// A verdict decided by its evidence (at_risk with lower(p2) >= 1/2, invalidated with
// upper(p2) < 1/2, at confidence 1 - alpha) keeps that bound in the CE's header, and stays in
// force under every later posterior q while certify.Carries holds at KL(q || q_v), q_v the
// posterior it was measured under (Theorem 1 on f and 1 - f: |p_q - p_v| <= the policy's mean
// slack). Confirm measures an at_risk or invalidated CE again only when its verdict decided
// nothing (kept by hysteresis) or no longer carries. idx_fail keeps such verdicts by version and
// carry margin, so the ones a KL stops carrying are found with one range scan per verdict
// version, the KL computed once per version, not per CE. The posteriors of verdicts are kept in
// memory (Confirm remembers the one it sampled): after a restart a verdict whose posterior is
// neither current nor an anchor is measured again, which costs a measurement, never a status.
// Confirm reports what became of each measurement (Measurements: kept, superseded, discarded). Audit re-measures every
// CE in batches, also outside the lock, with the same rules.
//
// # The outbox
//
// Every status change the ledger writes (Commit, Checkpoint, Confirm, Audit, a policy change at
// Open) is put in the outbox in its own transaction through Options.EncodeChange, and so are
// Checkpoint.Events. A publisher reads Outbox in order, publishes, and calls AckOutbox: events are
// delivered at least once, in the outbox's order, and never describe a change that was not
// committed. Sequence numbers are the ledger's: a ledger restored from a backup numbers again
// from the backup's.
//
// # Errors and recovery
//
// The file itself is package store's: Open takes the state directory's lock (ErrLocked for a
// second Open), creates the file only when it is missing, and refuses an empty, truncated or
// damaged file with a *CorruptError (ErrCorrupt) that names it and says how to recover, writing
// nothing to it; panics and faults inside bbolt, a damaged newest meta page and a commit that
// fails (ErrWrite, the ledger left exactly as before the call) are handled there too (see the
// store package's documentation). Open then reads every record once (quarantine.go): a damaged
// CE is moved to the quarantine bucket, counted (Damaged) and named in the log, and the indexes,
// counts and anchor references are rebuilt without it, so that one bad record never takes down a
// list, an audit or a re-certification; a damaged prequential record (quality.go) is deleted and
// named in the log; a damaged reissue entry (reissue.go) is written again, the CE still waiting,
// and named in the log; damage to any other record is a *CorruptError like structural damage.
//
// Backup streams a consistent snapshot while writers continue; Verify checks a file (structure,
// bbolt's tx.Check, every record and the invariants between them) without writing or locking it
// exclusively; Restore verifies a backup and installs it, never over an existing ledger. A backup
// whose only damage is damage Open repairs is installed as Open makes it, under the backup's own
// policy, and the repairs reported (Info.Repaired); it refuses any other.
//
// # Atomicity with the consumer
//
// The daemon's increment is: update -> Commit{Model: q_new, Offsets, Update, Events} (re-certify
// and checkpoint under one lock, one transaction) -> commit Kafka offsets -> Confirm. Checkpoint
// with a report from Recertify refuses it if CEs changed in between (ErrStale).
package ledger
