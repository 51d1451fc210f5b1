package ceshare

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/kafkatest"
)

// gapHooks is a ledger whose Lost and Reset may fail, recording each Reset's end and from.
type gapHooks struct {
	*ledger
	lostErr, resetErr error
	resets            [][2]int64 // end, from of each Reset
}

func (h *gapHooks) Lost(ctx context.Context, p int, from, to int64) error {
	if h.lostErr != nil {
		return h.lostErr
	}
	return h.ledger.Lost(ctx, p, from, to)
}

func (h *gapHooks) Reset(ctx context.Context, p int, end, from int64) error {
	h.resets = append(h.resets, [2]int64{end, from})
	if h.resetErr != nil {
		return h.resetErr
	}
	return h.ledger.Reset(ctx, p, end, from)
}

// errorLines returns the ERROR lines of a text log.
func errorLines(log string) []string {
	var out []string
	for line := range strings.Lines(log) {
		if strings.Contains(line, "level=ERROR") {
			out = append(out, line)
		}
	}
	return out
}

// TestOutOfRange pins what a fetch refused as out of range does, on a partition whose log
// starts at 2 (its first 2 requests deleted by retention) and ends at 3: below the start, the
// gap is stored (counted lost through Lost unless an earlier owner read the partition from 0,
// and the states of a first read from 0 restored before it), the member's offset moves to the
// start and the gap is logged at ERROR; past the end, Reset is told the end and the offset read
// to, the partition is read again from 0, not caught up nor blocked (the blocking record went
// with the old log); within the log, or when the log's offsets cannot be listed, nothing is
// done (the fetch is tried again, and fails again if it must). A hook's
// failure (or the run's end) is returned with the member's offset left where it was.
func TestOutOfRange(t *testing.T) {
	b, conn := startBrokerWith(t, broker.Config{RetentionCheckInterval: time.Hour})
	createTopic(t, conn, halfHourRetention)
	const p = 3
	old := time.Now().Add(-time.Hour)
	writeSigned(t, conn, p, kafka.Message{Value: []byte(`{}`), Time: old}, kafka.Message{Value: []byte(`{}`), Time: old})
	writeSigned(t, conn, p, readableRequest(t, idIn(p, "kept")))
	b.ApplyRetention()
	if start, end := b.LogStartOffsets(testTopic)[p], b.HighWatermarks(testTopic)[p]; start != 2 || end != 3 {
		t.Fatalf("partition %d holds offsets %d to %d, want 2 to 3", p, start, end)
	}
	ids := []string{idIn(p, "s"), idIn(p, "t")}
	states := map[string]State{}
	for _, id := range ids {
		states[id] = State{ID: id, Replica: "r0", CE: json.RawMessage(`{}`)}
	}
	failed, stopped := errors.New("store failed"), errors.New("the run ended")
	const (
		lostMsg   = `msg="CE requests were deleted before they were read: the CEs they registered or deleted are not in this share"`
		beforeMsg = `msg="CE requests were deleted before this replica read them, after an earlier owner of the partition did: ` +
			`the CEs they registered or deleted are not in this share; not counted as lost here"`
		restoredMsg = `msg="CE requests were deleted before this replica read them, after an earlier owner of the partition did: ` +
			`2 CEs they registered are restored from the states`
		resetMsg = `msg="CE partition ends before what this replica read`
	)
	for _, tc := range []struct {
		name     string
		topic    string    // testTopic when empty
		next     int64     // the offset refused, the ledger's and the member's
		ps       partState // the member's state of p (next is set)
		maxBatch int
		applyErr error // of Apply for restored registrations; stopped: the run ends at the first
		lostErr  error
		resetErr error
		want     int64 // returned
		wantErr  error
		stored   int64 // the ledger's offset after
		lost     int64 // counted lost by the ledger, and in Stats().Gaps
		restored []string
		handed   int // Apply calls with restored registrations
		resets   [][2]int64
		psNext   int64
		ready    bool
		blocked  bool
		logged   string // in the one ERROR line; none when empty
	}{
		{name: "a gap counted lost", want: 2, stored: 2, lost: 2, psNext: 2, logged: lostMsg},
		{name: "a gap after an earlier owner", ps: partState{ownedBefore: true}, want: 2, stored: 2, psNext: 2, logged: beforeMsg},
		{name: "a gap past offset 0 after an earlier owner", next: 1, ps: partState{ownedBefore: true, states: states},
			want: 2, stored: 2, lost: 1, psNext: 2, logged: lostMsg},
		{name: "a gap at the first read, restored from states", ps: partState{ownedBefore: true, states: states}, maxBatch: 1,
			want: 2, stored: 2, restored: ids, handed: 2, psNext: 2, logged: restoredMsg},
		{name: "a restore that fails", ps: partState{ownedBefore: true, states: states}, applyErr: failed,
			want: 0, wantErr: failed, handed: 1},
		{name: "the run ends during the restore", ps: partState{ownedBefore: true, states: states}, maxBatch: 1, applyErr: stopped,
			want: 0, wantErr: context.Canceled, restored: ids[:1], handed: 1},
		{name: "Lost fails", lostErr: failed, want: 0, wantErr: failed, logged: lostMsg},
		{name: "past the end", next: 5, ps: partState{ready: true, blocked: &Blocked{Partition: p, Offset: 4}},
			want: 0, resets: [][2]int64{{3, 5}}, logged: resetMsg},
		{name: "a reset that fails", next: 5, ps: partState{ready: true, blocked: &Blocked{Partition: p, Offset: 4}}, resetErr: failed,
			want: 5, wantErr: failed, stored: 5, resets: [][2]int64{{3, 5}}, psNext: 5, ready: true, blocked: true, logged: resetMsg},
		{name: "offsets not listed", topic: "cfguard.none", want: 0},
		{name: "at the log start", next: 2, want: 2, stored: 2, psNext: 2},
		{name: "at the end", next: 3, ps: partState{ready: true}, want: 3, stored: 3, psNext: 3, ready: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
			l := newLedger()
			l.owned[p], l.next[p] = true, tc.next
			handed := 0
			l.apply = func(_ int, reqs []Request) error {
				if len(reqs) == 0 || !reqs[0].Restored {
					return nil
				}
				handed++
				switch tc.applyErr {
				case nil:
					return nil
				case stopped:
					cancel()
					return nil
				}
				return tc.applyErr
			}
			h := &gapHooks{ledger: l, lostErr: tc.lostErr, resetErr: tc.resetErr}
			var out bytes.Buffer
			ps := tc.ps
			ps.next = tc.next
			m := &Member{cfg: MemberConfig{Topic: cmp.Or(tc.topic, testTopic), Partitions: testPartitions, MaxBatch: cmp.Or(tc.maxBatch, 1000)},
				hooks: h, log: slog.New(slog.NewTextHandler(&out, nil)), parts: map[int]*partState{p: &ps}}

			got, err := m.outOfRange(ctx, cl, p, tc.next)
			if got != tc.want || !errors.Is(err, tc.wantErr) || (err == nil) != (tc.wantErr == nil) {
				t.Errorf("outOfRange(%d) = %d, %v; want %d, %v", tc.next, got, err, tc.want, tc.wantErr)
			}
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.next[p] != tc.stored || l.lost[p] != tc.lost {
				t.Errorf("the ledger stored offset %d and counted %d lost; want %d and %d", l.next[p], l.lost[p], tc.stored, tc.lost)
			}
			var restored []string
			for id := range l.restored {
				restored = append(restored, id)
			}
			slices.Sort(restored)
			if !slices.Equal(restored, tc.restored) || handed != tc.handed {
				t.Errorf("restored %v in %d calls of Apply; want %v in %d", restored, handed, tc.restored, tc.handed)
			}
			if s := m.Stats(); s.Gaps != tc.lost || s.Restored != int64(len(tc.restored)) {
				t.Errorf("Stats(): %d gaps, %d restored; want %d and %d", s.Gaps, s.Restored, tc.lost, len(tc.restored))
			}
			if !slices.Equal(h.resets, tc.resets) {
				t.Errorf("Reset(end, from) calls %v; want %v", h.resets, tc.resets)
			}
			if ps.next != tc.psNext || ps.ready != tc.ready || (ps.blocked != nil) != tc.blocked {
				t.Errorf("the member's partition: next %d, ready %v, blocked %v; want %d, %v, blocked %v",
					ps.next, ps.ready, ps.blocked, tc.psNext, tc.ready, tc.blocked)
			}
			if len(l.bad) > 0 {
				t.Errorf("rules broken: %v", l.bad)
			}
			lines := errorLines(out.String())
			switch {
			case tc.logged == "" && len(lines) > 0:
				t.Errorf("logged %q; want no ERROR", lines)
			case tc.logged != "" && (len(lines) != 1 || !strings.Contains(lines[0], tc.logged) ||
				!strings.Contains(lines[0], fmt.Sprintf(" partition=%d ", p))):
				t.Errorf("logged %q; want one ERROR line of partition %d with %s", lines, p, tc.logged)
			}
		})
	}
}

// TestSameLog pins the check of a Witness, on a partition whose log starts at 1 (its first
// record deleted by retention) and holds 3 records, written in one batch, to its end at 4: the
// partition is another log (other) only when its record at the Witness's offset hashes
// otherwise, not when another record of the batch fetched does; with no record there (below the
// log start, or at the end) it cannot tell; end is the partition's end. A fetch that fails (the
// topic gone, or the partition's leader moving) is an error, so that the check is made again
// rather than skipped.
func TestSameLog(t *testing.T) {
	b, conn := startBrokerWith(t, broker.Config{RetentionCheckInterval: time.Hour})
	createTopic(t, conn, halfHourRetention)
	const p = 5
	writeSigned(t, conn, p, kafka.Message{Key: []byte("old"), Value: []byte(`{}`), Time: time.Now().Add(-time.Hour)})
	at := time.UnixMilli(time.Now().UnixMilli())
	var msgs []kafka.Message
	for i := range 3 {
		msgs = append(msgs, kafka.Message{Key: fmt.Appendf(nil, "k%d", i), Value: fmt.Appendf(nil, `{"v":%d}`, i), Time: at})
	}
	writeSigned(t, conn, p, msgs...)
	b.ApplyRetention()
	if start, end := b.LogStartOffsets(testTopic)[p], b.HighWatermarks(testTopic)[p]; start != 1 || end != 4 {
		t.Fatalf("partition %d holds offsets %d to %d, want 1 to 4", p, start, end)
	}
	// The Witness of the record at offset 2 (k1), as the store kept it.
	same := witnessOf(record{offset: 2, time: at, key: msgs[1].Key, value: msgs[1].Value})
	other := same
	other.Hash[0] ^= 1
	for _, tc := range []struct {
		name    string
		topic   string // testTopic when empty
		w       Witness
		other   bool
		end     int64 // -1: any (the caller does not read it)
		wantErr bool
	}{
		{name: "the record read", w: same, end: 4},
		{name: "another record at its offset", w: other, other: true, end: 4},
		{name: "no record: the partition ends at it", w: Witness{Offset: 4, Hash: other.Hash}, end: 4},
		{name: "no record: deleted by retention", w: Witness{Offset: 0, Hash: other.Hash}, end: -1},
		{name: "the topic gone", topic: "cfguard.none", w: other, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
			m := &Member{cfg: MemberConfig{Topic: cmp.Or(tc.topic, testTopic), FetchWait: 100 * time.Millisecond}, log: testLog(t)}
			got, end, err := m.sameLog(ctx, cl, p, tc.w)
			if got != tc.other || (end != tc.end && tc.end >= 0) || (err != nil) != tc.wantErr {
				t.Errorf("sameLog(offset %d) = %v, %d, %v; want %v, %d, error %v", tc.w.Offset, got, end, err, tc.other, tc.end, tc.wantErr)
			}
		})
	}
}

// TestSameLogFailsOnThePartitionsError: a fetch answered with the partition's error (its
// leader moving) is no answer about the record: sameLog returns the error, so that the check
// is made again, not skipped.
func TestSameLogFailsOnThePartitionsError(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(testPartitions, testTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	failPartitions(t, kc, kmsg.Fetch, kafka.NotLeaderForPartition, nil)
	cl := &kafka.Client{Addr: kafka.TCP(kc.ListenAddrs()...), Transport: kafkatest.Transport(t)}
	m := &Member{cfg: MemberConfig{Topic: testTopic, FetchWait: 100 * time.Millisecond}, log: testLog(t)}
	if other, end, err := m.sameLog(context.Background(), cl, 3, Witness{Offset: 0}); !errors.Is(err, kafka.NotLeaderForPartition) {
		t.Errorf("sameLog with the partition's error: %v, %d, %v; want %v", other, end, err, kafka.NotLeaderForPartition)
	}
}
