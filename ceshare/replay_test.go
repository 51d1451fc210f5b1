package ceshare

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// applyCall is one call of Apply as applyHooks saw it: the offsets of its requests, its next,
// and its Witness's offset (-1 when none).
type applyCall struct {
	offsets []int64
	next    int64
	w       int64
}

func (c applyCall) String() string { return fmt.Sprintf("%v next %d w %d", c.offsets, c.next, c.w) }

// applyHooks is a ledger that records each call of Apply, and may fail the call numbered fail
// (from 1) or end the run (cancel) during the call numbered stop.
type applyHooks struct {
	*ledger
	calls      []applyCall
	fail, stop int
	err        error
	cancel     context.CancelFunc
}

func (h *applyHooks) Apply(ctx context.Context, p int, reqs []Request, next int64, w *Witness) error {
	c := applyCall{next: next, w: -1}
	for _, r := range reqs {
		c.offsets = append(c.offsets, r.Offset)
	}
	if w != nil {
		c.w = w.Offset
	}
	h.calls = append(h.calls, c)
	switch len(h.calls) {
	case h.fail:
		return h.err
	case h.stop:
		h.cancel()
	}
	return h.ledger.Apply(ctx, p, reqs, next, w)
}

// TestApplyInChunks pins how a fetched batch reaches Apply: in chunks of MaxBatch requests, in
// order, each stored with the offset of the request after it and no Witness, the last one with
// the offset after the whole batch (past records left out) and the Witness; records left out
// alone are stored as an empty call; nothing read, no call. The member's offset follows each
// chunk stored, and so does Stats().Applied. A failed Apply returns its error with the offset of
// the last chunk stored; a run that ends stops between chunks, with that offset and no error.
func TestApplyInChunks(t *testing.T) {
	const p = 4
	failed := errors.New("store failed")
	batch := func(offsets ...int64) []offsetRequest {
		var out []offsetRequest
		for _, o := range offsets {
			out = append(out, offsetRequest{req: Request{Kind: KindDelete, ID: idIn(p, fmt.Sprintf("c%d", o)), Offset: o}, offset: o})
		}
		return out
	}
	for _, tc := range []struct {
		name        string
		batch       []offsetRequest
		after       int64 // next is 10
		maxBatch    int
		fail, stop  int
		want        []applyCall
		wantNext    int64
		wantErr     error
		wantApplied int64
	}{
		{name: "one chunk", batch: batch(10, 11, 12, 13, 14), after: 16, maxBatch: 1000,
			want: []applyCall{{[]int64{10, 11, 12, 13, 14}, 16, 15}}, wantNext: 16, wantApplied: 5},
		{name: "chunks of 2", batch: batch(10, 11, 12, 13, 14), after: 16, maxBatch: 2,
			want:     []applyCall{{[]int64{10, 11}, 12, -1}, {[]int64{12, 13}, 14, -1}, {[]int64{14}, 16, 15}},
			wantNext: 16, wantApplied: 5},
		{name: "a batch of MaxBatch", batch: batch(10, 12), after: 16, maxBatch: 2,
			want: []applyCall{{[]int64{10, 12}, 16, 15}}, wantNext: 16, wantApplied: 2},
		{name: "records left out alone", after: 16, maxBatch: 2, want: []applyCall{{nil, 16, 15}}, wantNext: 16},
		{name: "nothing read", after: 10, maxBatch: 2, wantNext: 10},
		{name: "the second chunk fails", batch: batch(10, 11, 12, 13, 14), after: 16, maxBatch: 2, fail: 2,
			want: []applyCall{{[]int64{10, 11}, 12, -1}, {[]int64{12, 13}, 14, -1}}, wantNext: 12, wantErr: failed, wantApplied: 2},
		{name: "the run ends during the first chunk", batch: batch(10, 11, 12, 13, 14), after: 16, maxBatch: 2, stop: 1,
			want: []applyCall{{[]int64{10, 11}, 12, -1}}, wantNext: 12, wantApplied: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			l := newLedger()
			l.owned[p], l.next[p] = true, 10
			h := &applyHooks{ledger: l, fail: tc.fail, stop: tc.stop, err: failed, cancel: cancel}
			ps := &partState{next: 10}
			m := &Member{cfg: MemberConfig{Partitions: testPartitions, MaxBatch: tc.maxBatch}, hooks: h, log: testLog(t),
				parts: map[int]*partState{p: ps}}
			w := &Witness{Offset: 15}
			got, err := m.apply(ctx, p, tc.batch, 10, tc.after, w)
			if got != tc.wantNext || !errors.Is(err, tc.wantErr) || (err == nil) != (tc.wantErr == nil) {
				t.Errorf("apply = %d, %v; want %d, %v", got, err, tc.wantNext, tc.wantErr)
			}
			if !slices.EqualFunc(h.calls, tc.want, func(a, b applyCall) bool {
				return slices.Equal(a.offsets, b.offsets) && a.next == b.next && a.w == b.w
			}) {
				t.Errorf("Apply calls %v; want %v", h.calls, tc.want)
			}
			if ps.next != tc.wantNext || m.Stats().Applied != tc.wantApplied {
				t.Errorf("the member's offset %d, %d applied; want %d and %d", ps.next, m.Stats().Applied, tc.wantNext, tc.wantApplied)
			}
			if bad := l.problems(); len(bad) > 0 {
				t.Errorf("rules broken: %v", bad)
			}
		})
	}
}

// TestWitnessCoversTimeKeyAndValue: a record's Witness is its offset and a hash of its
// timestamp (to the millisecond, as the topic keeps it), its key and its value, with the key's
// length, so that records that differ in any of them, or split the same bytes otherwise between
// key and value, hash otherwise.
func TestWitnessCoversTimeKeyAndValue(t *testing.T) {
	at := time.UnixMilli(1_700_000_000_000)
	base := record{offset: 7, time: at, key: []byte("ab"), value: []byte("cd")}
	w := witnessOf(base)
	if w.Offset != 7 {
		t.Fatalf("Witness offset %d, want 7", w.Offset)
	}
	if again := witnessOf(record{offset: 7, time: at.Add(999 * time.Microsecond), key: []byte("ab"), value: []byte("cd"), auth: []byte("x")}); again != w {
		t.Errorf("the same record (its time within the millisecond, another authenticator) hashes otherwise")
	}
	for _, tc := range []struct {
		name string
		r    record
	}{
		{"another timestamp", record{offset: 7, time: at.Add(time.Millisecond), key: base.key, value: base.value}},
		{"another key", record{offset: 7, time: at, key: []byte("ax"), value: base.value}},
		{"another value", record{offset: 7, time: at, key: base.key, value: []byte("cx")}},
		{"the bytes split otherwise", record{offset: 7, time: at, key: []byte("a"), value: []byte("bcd")}},
	} {
		if witnessOf(tc.r).Hash == w.Hash {
			t.Errorf("%s: the same hash", tc.name)
		}
	}
}

// TestMemberConfigDefaults: a configuration without the topic, the group, a partition count of
// at least 1, the replica id, the keys or the advertised URL is refused, naming what is missing,
// as are a heartbeat interval not below the session timeout and negative durations or bounds;
// what is left zero takes its documented default.
func TestMemberConfigDefaults(t *testing.T) {
	valid := func() MemberConfig {
		return MemberConfig{Topic: "t", Group: "g", Partitions: 1, ReplicaID: "r1", Keys: &clusterkey.Keyring{}, AdvertiseURL: "http://r1"}
	}
	for _, tc := range []struct {
		name   string
		change func(*MemberConfig)
		want   string // in the error
	}{
		{"no topic", func(c *MemberConfig) { c.Topic = "" }, "replication.ce_topic"},
		{"no group", func(c *MemberConfig) { c.Group = "" }, "CE group"},
		{"no partitions", func(c *MemberConfig) { c.Partitions = 0 }, "replication.ce_partitions 0"},
		{"no replica id", func(c *MemberConfig) { c.ReplicaID = "" }, "replication.replica_id"},
		{"no keys", func(c *MemberConfig) { c.Keys = nil }, "replication.key_file"},
		{"no URL", func(c *MemberConfig) { c.AdvertiseURL = "" }, "replication.advertise_url"},
		{"a heartbeat as long as the session", func(c *MemberConfig) { c.SessionTimeout, c.HeartbeatInterval = time.Second, time.Second },
			"replication.heartbeat_interval"},
		{"a negative heartbeat", func(c *MemberConfig) { c.HeartbeatInterval = -time.Second }, "replication.heartbeat_interval"},
		{"a negative retry", func(c *MemberConfig) { c.RetryMin = -time.Second }, "RetryMin"},
		{"a negative witness interval", func(c *MemberConfig) { c.WitnessEvery = -time.Second }, "WitnessEvery"},
		{"a negative batch", func(c *MemberConfig) { c.MaxBatch = -1 }, "MaxBatch"},
		{"a negative fetch bound", func(c *MemberConfig) { c.FetchMaxBytes = -1 }, "FetchMaxBytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := valid()
			tc.change(&c)
			if err := c.applyDefaults(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("applyDefaults: %v; want an error naming %q", err, tc.want)
			}
		})
	}
	c := valid()
	if err := c.applyDefaults(); err != nil {
		t.Fatal(err)
	}
	got := []any{c.SessionTimeout, c.HeartbeatInterval, c.RebalanceTimeout, c.JoinBackoff, c.FetchWait, c.FetchMaxBytes, c.MaxBatch,
		c.RetryMin, c.RetryMax, c.ReleaseWait, c.WitnessEvery, c.decode != nil}
	want := []any{10 * time.Second, time.Second, 10 * time.Second, time.Second, 500 * time.Millisecond, 1 << 20, 1000,
		50 * time.Millisecond, 5 * time.Second, 10 * time.Second, 10 * time.Second, true}
	if !slices.Equal(got, want) {
		t.Errorf("defaults %v; want %v", got, want)
	}
}

// A partition is ready only once the member has applied its requests up to the end the last
// fetch saw: a member whose fetch reads part of the partition (FetchMaxBytes) holds it, not
// ready, at the offset it read to, until a fetch reads on to the end.
func TestPartitionReadyOnceReadToItsEnd(t *testing.T) {
	_, conn := startBroker(t)
	createTopic(t, conn)
	const p = 2
	for i := range 3 { // three batches: a fetch of one byte at most reads one
		writeSigned(t, conn, p, readableRequest(t, idIn(p, fmt.Sprintf("r%d", i))))
	}
	at1 := newStop(1)
	at1.arm()
	cfg := memberConfig(conn, "r1")
	cfg.FetchMaxBytes = 1
	cfg.beforeFetch = func(q int, next int64) {
		if q == p {
			at1.reach(next)
		}
	}
	l := newLedger()
	r := startReplicaOn(t, cfg, l)
	at1.wait(t)
	if next, ok := r.m.Next(p); !ok || next != 1 || l.stored(p) != 1 || r.m.Ready(p) {
		t.Errorf("held after the first batch: offset %d (held %v), stored %d, ready %v; want 1, 1, not ready", next, ok, l.stored(p), r.m.Ready(p))
	}
	at1.release()
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d read to its end, 3, and ready", p), func() bool {
		return l.stored(p) == 3 && r.m.Ready(p)
	})
}
