package ledger

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger/store"
)

// The record check at Open, and the quarantine of damaged counterfactuals.
//
// The page walk (package store) checks the file's structure, not its values; each value carries
// its own CRC-32C (store.Seal). Open reads every value once, after the walk: O(records), about a
// second per million CEs, with progress logged every few seconds. Damage is then handled by what
// the record is:
//
//   - a CE (header or body, including a header or body whose partner is missing): the CE is
//     moved to the quarantine bucket with its raw bytes and the reason, the anchors' reference
//     counts are recounted, unreferenced anchors released and the indexes and status counts
//     rebuilt from the remaining CEs (rebuildTx), in one transaction, so every invariant Verify
//     checks holds again. Each is named in an ERROR log line. A quarantined CE reads as
//     ErrQuarantined (not ErrNotFound), lists and audits no longer meet it, and Damaged counts it
//     until it is deleted or registered again;
//   - an index entry: the indexes are derived data, rebuilt the same way;
//   - a prequential record (quality.go): it only feeds the daemon's prequential scores, and
//     nothing can rebuild it, so it is deleted and named in an ERROR log line; the scores go on
//     from the records kept;
//   - the kept newest KL breach and failure (meta kl_breach, kl_failed): they only date alerts,
//     so Open deletes a damaged one (checkKept) and names it in an ERROR log line;
//   - anything else (meta, offsets and their marks, counters, anchors, posteriors, KL history, outbox): the ledger
//     cannot run without it, so Open refuses the file with a *CorruptError, as for structural
//     damage.
//
// Restore installs a backup whose only damage is of the kinds above as Open makes it, under the
// backup's own policy, and reports the repairs (Repairs, in Info.Repaired); it refuses any other.
//
// The check comes before the rebuild of the indexes for a changed policy (prepare), which then
// happens in the quarantine's transaction: the rebuild judges the CEs left, never a damaged one.
//
// A CE found damaged after Open (the disk failing under a running daemon) is skipped by List,
// logged and counted; the next Open quarantines it. A deletion of it deletes it at once: the
// deletion's transaction quarantines it, with every other CE whose header is damaged, as Open
// would, then drops its record (deleteOne), so that the request is applied, not failed.

// bQuarantine holds the quarantined CEs: id -> quarantined-at, reason, raw header, raw body.
var bQuarantine = []byte("quarantine")

// ErrQuarantined: the counterfactual was found damaged on disk and quarantined (see Damaged).
var ErrQuarantined = errors.New("counterfactual damaged on disk and quarantined")

// Repairs is what Open's record check repaired in a ledger file, the damage Open runs on:
// Restore reports it for a backup it installed (Info.Repaired).
type Repairs struct {
	// Quarantined are the CEs whose record was damaged, moved to the quarantine bucket with
	// their raw bytes, by id.
	Quarantined []QuarantinedCE `json:"quarantined,omitempty"`
	// IndexEntries is the number of damaged index entries; the indexes were rebuilt.
	IndexEntries int `json:"index_entries,omitempty"`
	// QualityRecords is the number of damaged prequential records deleted.
	QualityRecords int `json:"quality_records,omitempty"`
	// ReissueEntries is the number of damaged reissue entries written again.
	ReissueEntries int `json:"reissue_entries,omitempty"`
	// AnchorKLHistories is the number of damaged anchor KL histories deleted.
	AnchorKLHistories int `json:"anchor_kl_histories,omitempty"`
	// AnchorKLStrays is the number of anchor KL records no stored anchor's history reaches,
	// deleted.
	AnchorKLStrays int `json:"anchor_kl_strays,omitempty"`
	// KeptEvents are the damaged records of the last KL events deleted (meta kl_breach,
	// kl_failed).
	KeptEvents []string `json:"kept_events,omitempty"`
}

// QuarantinedCE is a counterfactual Open found damaged and quarantined, and what is wrong.
type QuarantinedCE struct {
	ID     string `json:"id"`
	Reason string `json:"reason"`
}

// progressEvery is how often a long record check logs its progress.
const progressEvery = 5 * time.Second

// Damaged is the number of damaged CE records: those in quarantine (found at Open, now or
// earlier) and those a read found damaged since. Deleting a quarantined CE, or registering its
// id again, takes it off the count.
func (l *Ledger) Damaged() int {
	n := 0
	err := l.view(func(tx *bolt.Tx) error {
		if q := tx.Bucket(bQuarantine); q != nil {
			n = q.Stats().KeyN
		}
		return nil
	})
	l.dmu.Lock()
	defer l.dmu.Unlock()
	if err != nil {
		n = l.quarantined // closed or failing: the last count read
	}
	l.quarantined = n
	return n + len(l.runtimeDamaged)
}

// forgetDeleted takes off the count of CEs reads found damaged those no longer stored (deleted
// with their record, as a body a read found damaged is).
func (l *Ledger) forgetDeleted() {
	l.dmu.Lock()
	ids := slices.Collect(maps.Keys(l.runtimeDamaged))
	l.dmu.Unlock()
	if len(ids) == 0 {
		return
	}
	var gone []string
	_ = l.view(func(tx *bolt.Tx) error { // not under dmu: reads take it; on an error, the next deletion tries again
		gone = gone[:0]
		for _, id := range ids {
			if tx.Bucket(bHeaders).Get([]byte(id)) == nil {
				gone = append(gone, id)
			}
		}
		return nil
	})
	l.dmu.Lock()
	for _, id := range gone {
		delete(l.runtimeDamaged, id)
	}
	l.dmu.Unlock()
}

// noteDamaged logs a CE a read found damaged (once per id) and counts it.
func (l *Ledger) noteDamaged(id []byte, err error) {
	l.dmu.Lock()
	defer l.dmu.Unlock()
	if l.runtimeDamaged == nil {
		l.runtimeDamaged = map[string]bool{}
	}
	if l.runtimeDamaged[string(id)] {
		return
	}
	l.runtimeDamaged[string(id)] = true
	l.log.Error("ledger: a counterfactual record is damaged; lists skip it, and the next start quarantines it",
		"path", l.path, "id", string(id), "err", err)
}

// damage is what the record check found.
type damage struct {
	ces     map[string]string // CE id -> what is wrong
	index   int               // damaged index entries
	quality []qualityDropped  // damaged prequential records
	reissue [][]byte          // CE ids whose reissue entry is damaged
	klHist  klDamage          // damaged anchor KL histories, and entries no history reaches
	records int               // values read
}

// qualityDropped is a damaged prequential record: its key, and what is wrong.
type qualityDropped struct {
	key []byte
	why string
}

// checkRecords reads every value of a schema-2 ledger, quarantines damaged CEs, rebuilds
// damaged indexes, drops damaged prequential records and writes damaged reissue entries again
// (repairReissues); other damage is a *CorruptError. With
// rebuild (the policy changed, prepare), it rebuilds the indexes whatever it found, from the CEs
// left after the quarantine: the old indexes are not read, and a damaged CE never reaches the
// rebuild.
func (l *Ledger) checkRecords(rebuild bool) error {
	start := time.Now()
	var d damage
	err := l.view(func(tx *bolt.Tx) (err error) {
		d, err = l.scanRecords(tx, start, !rebuild)
		return err
	})
	if err != nil {
		return err
	}
	l.log.Info("ledger: records checked", "path", l.path, "records", d.records, "damaged_counterfactuals", len(d.ces),
		"damaged_index_entries", d.index, "damaged_quality_records", len(d.quality), "damaged_reissue_entries", len(d.reissue),
		"took", time.Since(start))
	l.repairs.QualityRecords, l.repairs.ReissueEntries = len(d.quality), len(d.reissue)
	l.repairs.AnchorKLHistories, l.repairs.AnchorKLStrays = len(d.klHist.anchors), len(d.klHist.strays)
	l.repairs.IndexEntries = d.index
	if len(d.quality) > 0 {
		if err := l.dropQuality(d.quality); err != nil {
			return err
		}
	}
	if len(d.reissue) > 0 {
		if err := l.repairReissues(d.reissue); err != nil {
			return err
		}
	}
	if l.repairs.AnchorKLHistories+l.repairs.AnchorKLStrays > 0 {
		if err := l.repairAnchorKL(d.klHist); err != nil {
			return err
		}
	}
	if len(d.ces) > 0 || d.index > 0 || rebuild {
		return l.quarantine(d, rebuild)
	}
	return nil
}

// dropQuality deletes the damaged prequential records, naming each in an ERROR log line.
func (l *Ledger) dropQuality(recs []qualityDropped) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	err := l.update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bQuality)
		for _, r := range recs {
			if err := b.Delete(r.key); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return corrupt(l.path, fmt.Errorf("ledger: dropping %d damaged prequential records: %w", len(recs), err))
	}
	for _, r := range recs {
		args := []any{"path", l.path, "key", fmt.Sprintf("%x", r.key), "reason", r.why}
		if len(r.key) == 8 {
			args = append(args, "seq", binary.BigEndian.Uint64(r.key))
		}
		l.log.Error("ledger: a prequential record (bucket quality) is damaged; it was deleted, and the prequential scores and "+
			"change detector go on from the records kept", args...)
	}
	return nil
}

// scanRecords checks every value: its CRC-32C, the decoding of CE headers and the keys of
// prequential records. With indexes
// false the index entries are not read (they are about to be rebuilt).
func (l *Ledger) scanRecords(tx *bolt.Tx, start time.Time, indexes bool) (damage, error) {
	d := damage{ces: map[string]string{}}
	if _, _, err := readMarks(tx); err != nil {
		return d, err
	}
	if _, err := readOffsets(tx); err != nil {
		return d, err
	}
	if _, err := readCounters(tx); err != nil {
		return d, err
	}
	if err := checkSequences(tx, &Info{}); err != nil {
		return d, err
	}
	cnt, err := readCounts(tx)
	if err != nil {
		return d, err
	}
	var total int64
	for _, c := range cnt {
		total += c
	}
	last := start
	tick := func() {
		d.records++
		if d.records%1024 == 0 && time.Since(last) >= progressEvery {
			last = time.Now()
			l.log.Info("ledger: checking records", "path", l.path, "counterfactuals", total, "records_read", d.records,
				"elapsed", time.Since(start).Round(time.Second))
		}
	}
	hdrs, bodies := tx.Bucket(bHeaders), tx.Bucket(bBodies)
	mark := func(k []byte, why string) {
		if _, ok := d.ces[string(k)]; !ok {
			d.ces[string(k)] = why
		}
	}
	hdrs.ForEach(func(k, v []byte) error {
		tick()
		if why := headerDamage(k, v); why != "" {
			mark(k, why)
		}
		if bodies.Get(k) == nil {
			mark(k, "body missing")
		}
		return nil
	})
	bodies.ForEach(func(k, v []byte) error {
		tick()
		// The checksum only: a body that passes it is one the ledger wrote (decoding every
		// body, with its history, would triple the cost of the check).
		if _, ok := unseal(k, v); !ok {
			mark(k, "body checksum mismatch")
		}
		if hdrs.Get(k) == nil {
			mark(k, "header missing")
		}
		return nil
	})
	if q := tx.Bucket(bQuality); q != nil {
		q.ForEach(func(k, v []byte) error {
			tick()
			if why := qualityDamage(k, v); why != "" {
				d.quality = append(d.quality, qualityDropped{key: bytes.Clone(k), why: why})
			}
			return nil
		})
	}
	if r := tx.Bucket(bReissue); r != nil {
		r.ForEach(func(k, v []byte) error {
			tick()
			if _, ok := decodeReissue(k, v); !ok {
				d.reissue = append(d.reissue, bytes.Clone(k))
			}
			return nil
		})
	}
	// The anchors' KL histories against the anchors; a damaged anchor record is not this
	// check's to report (the checks that read anchors refuse it), and leaves the histories as
	// they are.
	anchors := map[uint64]anchorMeta{}
	if err := forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		anchors[v] = a
		return nil
	}); err == nil {
		d.klHist = anchorKLDamage(tx, anchors)
	}
	for _, b := range indexBuckets {
		if !indexes {
			break
		}
		tx.Bucket(b).ForEach(func(k, v []byte) error {
			tick()
			if _, ok := unseal(k, v); !ok {
				d.index++
			}
			return nil
		})
	}
	return d, nil
}

// quarantine moves the damaged CEs to bQuarantine and rebuilds what depends on the CEs (anchor
// references, indexes, status counts) in one transaction (quarantineTx). With rebuild (a changed
// policy), the rebuild re-judges the CEs left under the ledger's policy, as for any rebuild.
func (l *Ledger) quarantine(d damage, rebuild bool) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	ids := slices.Sorted(maps.Keys(d.ces))
	start := time.Now()
	var n, changed int
	err := l.update(func(tx *bolt.Tx) (err error) {
		n, changed, err = l.quarantineTx(tx, d.ces)
		return err
	})
	if err != nil {
		if len(ids) > 0 {
			err = fmt.Errorf("ledger: quarantining %d damaged counterfactuals: %w", len(ids), err)
		}
		return corrupt(l.path, err)
	}
	for _, id := range ids {
		l.repairs.Quarantined = append(l.repairs.Quarantined, QuarantinedCE{ID: id, Reason: d.ces[id]})
	}
	if rebuild {
		l.log.Info("ledger: indexes built", "path", l.path, "counterfactuals", n, "changed_status", changed, "took", time.Since(start))
	}
	for i, id := range ids {
		if i == 100 {
			l.log.Error("ledger: more damaged counterfactuals quarantined; list them with the quarantine bucket of a backup",
				"path", l.path, "more", len(ids)-i)
			break
		}
		l.log.Error("ledger: a counterfactual record is damaged; it was quarantined (GET answers 500 for it until it is "+
			"deleted or registered again)", "path", l.path, "id", id, "reason", d.ces[id])
	}
	if d.index > 0 {
		l.log.Error("ledger: damaged index entries; the indexes were rebuilt from the counterfactuals", "path", l.path,
			"entries", d.index)
	}
	return nil
}

// quarantineTx moves the CEs ces (id -> what is wrong) to bQuarantine in tx, with their raw
// bytes and the reason, and recounts the anchors' references (releasing the anchors no CE
// refers to any more); then, with ces empty too, it rebuilds the indexes and status counts from
// the CEs left (rebuildTx, whose counts it returns).
func (l *Ledger) quarantineTx(tx *bolt.Tx, ces map[string]string) (n, changed int, err error) {
	if len(ces) > 0 {
		q, err := tx.CreateBucketIfNotExists(bQuarantine)
		if err != nil {
			return 0, 0, err
		}
		now := l.opts.Now().UTC()
		hdrs, bodies := tx.Bucket(bHeaders), tx.Bucket(bBodies)
		for _, id := range slices.Sorted(maps.Keys(ces)) {
			k := []byte(id)
			if err := putSealed(q, k, encodeQuarantined(now, ces[id], hdrs.Get(k), bodies.Get(k))); err != nil {
				return 0, 0, err
			}
			if err := hdrs.Delete(k); err != nil {
				return 0, 0, err
			}
			if err := bodies.Delete(k); err != nil {
				return 0, 0, err
			}
		}
		if err := l.recountAnchors(tx); err != nil {
			return 0, 0, err
		}
	}
	return l.rebuildTx(tx)
}

// deletedDamaged is what a deletion found damaged since Open and quarantined in its
// transaction (quarantineDamaged): id -> what is wrong, and whether the deletion then dropped
// it. reportDamaged reports it once the transaction commits.
type deletedDamaged map[string]damagedCE

type damagedCE struct {
	why      string
	deleted  bool // by a deletion of its id
	released bool // with its partition, to the partition's next owner
	replaced bool // by a registration of its id after it was quarantined
}

// headerDamage says what is wrong with the stored header k = v, "" when nothing is.
func headerDamage(k, v []byte) string {
	p, ok := unseal(k, v)
	if !ok {
		return "header checksum mismatch"
	}
	if _, err := decodeHeader(p); err != nil {
		return "header: " + store.Reason(err)
	}
	return ""
}

// readHeaderForDeletion says whether key holds a CE header a deletion can read. A damaged one
// is quarantined, with every other damaged header (quarantineDamaged), and reads as absent.
func (l *Ledger) readHeaderForDeletion(tx *bolt.Tx, key []byte, found deletedDamaged) (ok bool, err error) {
	_, ok, err = readHeader(tx, key)
	if errors.Is(err, ErrCorrupt) {
		return false, l.quarantineDamaged(tx, string(key), store.Reason(err), found)
	}
	return ok, err
}

// quarantineDamaged quarantines in tx, as Open would, the CE id whose header a deletion found
// damaged (why), with every other CE whose header is damaged: the rebuild that follows a
// quarantine reads every header. found gets them all. O(stored CEs), paid only when a
// deletion meets a damaged record.
func (l *Ledger) quarantineDamaged(tx *bolt.Tx, id, why string, found deletedDamaged) error {
	ces := map[string]string{id: why}
	err := tx.Bucket(bHeaders).ForEach(func(k, v []byte) error {
		if why := headerDamage(k, v); why != "" {
			ces[string(k)] = why
		}
		return nil
	})
	if err != nil {
		return err
	}
	if _, _, err := l.quarantineTx(tx, ces); err != nil {
		return err
	}
	for k, why := range ces {
		found[k] = damagedCE{why: why}
	}
	return nil
}

// reportDamaged logs, once the deletion's transaction committed, each CE it quarantined or
// dropped, and takes them, and every CE reads found damaged that is no longer stored, off the
// count of CEs reads found damaged: the quarantine counts those it keeps.
func (l *Ledger) reportDamaged(found deletedDamaged) {
	l.forgetDeleted()
	if len(found) == 0 {
		return
	}
	l.dmu.Lock()
	for id := range found {
		delete(l.runtimeDamaged, id)
	}
	l.dmu.Unlock()
	for i, id := range slices.Sorted(maps.Keys(found)) {
		if i == 100 {
			l.log.Error("ledger: more damaged counterfactuals quarantined by a deletion; list them with the quarantine bucket of a backup",
				"path", l.path, "more", len(found)-i)
			break
		}
		switch d := found[id]; {
		case d.deleted:
			l.log.Error("ledger: a counterfactual record is damaged; a deletion of it deleted it", "path", l.path, "id", id, "reason", d.why)
		case d.released:
			l.log.Error("ledger: a counterfactual record is damaged; it was dropped with its partition, whose next owner "+
				"stores it again from the CE topic", "path", l.path, "id", id, "reason", d.why)
		case d.replaced:
			l.log.Error("ledger: a counterfactual record is damaged; a registration of its id replaced it",
				"path", l.path, "id", id, "reason", d.why)
		default:
			l.log.Error("ledger: a counterfactual record is damaged; it was quarantined (GET answers 500 for it until it is "+
				"deleted or registered again)", "path", l.path, "id", id, "reason", d.why)
		}
	}
}

// recountAnchors sets every anchor's reference count to the number of CEs holding a
// certificate under it, and releases the anchors no CE refers to.
func (l *Ledger) recountAnchors(tx *bolt.Tx) error {
	refs := map[uint64]uint64{}
	err := tx.Bucket(bHeaders).ForEach(func(k, v []byte) error {
		h, _, err := readHeader(tx, k)
		if err == nil && h.status != certify.Uncertified {
			refs[h.anchor]++
		}
		return err
	})
	if err != nil {
		return err
	}
	err = forEachAnchor(tx, func(v uint64, a anchorMeta) error {
		if a.refs != refs[v] {
			a.refs = refs[v]
			if err := putAnchor(tx, v, a); err != nil {
				return err
			}
		}
		delete(refs, v)
		return nil
	})
	if err != nil {
		return err
	}
	for v := range refs {
		return corruptf("counterfactuals refer to anchor %d, which is not stored", v)
	}
	c, err := readCur(tx)
	if err != nil {
		return err
	}
	return l.gcAnchors(tx, c.version)
}

// encodeQuarantined is a quarantine record: time (unix ns), reason, raw header, raw body, each
// byte string length-prefixed.
func encodeQuarantined(at time.Time, why string, hdr, body []byte) []byte {
	v := binary.BigEndian.AppendUint64(nil, uint64(at.UnixNano()))
	for _, b := range [][]byte{[]byte(why), hdr, body} {
		v = binary.AppendUvarint(v, uint64(len(b)))
		v = append(v, b...)
	}
	return v
}

// quarantineReason returns why id was quarantined ("" and false when it was not).
func quarantineReason(tx *bolt.Tx, id []byte) (string, bool) {
	q := tx.Bucket(bQuarantine)
	if q == nil {
		return "", false
	}
	v := q.Get(id)
	if v == nil {
		return "", false
	}
	p, ok := unseal(id, v)
	if !ok || len(p) < 8 {
		return "its quarantine record is damaged too", true
	}
	n, k := binary.Uvarint(p[8:])
	if k <= 0 || n > uint64(len(p)-8-k) {
		return "its quarantine record is damaged too", true
	}
	return string(p[8+k : 8+k+int(n)]), true
}
