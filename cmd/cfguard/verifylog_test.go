package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// verify-log reports an increment that covers offsets past the input topic's end as a mismatch
// (exit 1), not as input past retention, and plays the log as the replicas do: the entry is not
// the head, the valid entry after it is. Records that do not authenticate are listed and ignored.
func TestVerifyLogCoveragePastTheEnd(t *testing.T) {
	b := startBroker(t)
	dir := t.TempDir()
	keyFile := clusterKey(t, dir)
	keys, err := clusterkey.Load(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	conn := stream.ConnConfig{Brokers: b.Addrs()}
	plog, err := postlog.Open(ctx, conn, "cfguard.posterior", keys, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer plog.Close()
	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 1, rand.New(rand.NewPCG(1, 2)))
	body, err := postlog.NewBody(m)
	if err != nil {
		t.Fatal(err)
	}
	sha, err := postlog.PosteriorHash(m)
	if err != nil {
		t.Fatal(err)
	}
	var prev []byte
	var seq uint64
	appendEntry := func(e *postlog.Entry, sign bool) {
		t.Helper()
		if prev != nil {
			h := postlog.Hash(prev)
			e.Parent = hex.EncodeToString(h[:])
		}
		v, err := e.Encode()
		if err != nil {
			t.Fatal(err)
		}
		if sign {
			if err := plog.Append(ctx, fmt.Sprintf("e/%d", e.Seq), v); err != nil {
				t.Fatal(err)
			}
			return
		}
		w := &kafka.Writer{Addr: kafka.TCP(b.Addrs()...), Topic: "cfguard.posterior", RequiredAcks: kafka.RequireAll}
		defer w.Close()
		if err := w.WriteMessages(ctx, kafka.Message{Value: v}); err != nil {
			t.Fatal(err)
		}
	}
	accept := func(e *postlog.Entry) {
		t.Helper()
		appendEntry(e, true)
		prev, _ = e.Encode()
		seq = e.Seq
	}
	accept(&postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Writer: "r1/1", Body: body, PosteriorSHA256: sha})
	accept(&postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: seq + 1, Term: 1, Writer: "r1/1", PosteriorSHA256: sha})
	inc := func(to int64) *postlog.Entry {
		return &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: seq + 1, Term: 1, Writer: "r1/1", Covers: map[int]int64{0: to},
			Outcome: postlog.Skipped, Counts: &postlog.Counts{}, PosteriorSHA256: sha}
	}
	appendEntry(inc(500), false) // unauthenticated, past the end: ignored before its coverage is looked at
	appendEntry(inc(500), true)  // authenticated, past the end: a mismatch
	accept(inc(0))               // the valid successor: covers nothing
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf("kafka:\n  brokers: [%s]\nreplication:\n  enabled: true\n  key_file: %s\nlog:\n  level: error\n",
		strings.Join(b.Addrs(), ", "), keyFile)), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errs := runCLI(t, "verify-log", "--config", cfg)
	var rep verifyReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("verify-log: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	if code != 1 || !strings.Contains(errs, "do not match") {
		t.Errorf("verify-log: exit %d, %s; want 1 and the mismatch said", code, errs)
	}
	if len(rep.Mismatches) != 1 || rep.Mismatches[0].Offset != 3 || !strings.Contains(rep.Mismatches[0].Why, "partition 0 to offset 500, and the partition ends at 0") {
		t.Errorf("mismatches %+v, want the entry at offset 3 covering past the end", rep.Mismatches)
	}
	if len(rep.Unverifiable) != 0 {
		t.Errorf("unverifiable %+v: coverage past the end is not input past retention", rep.Unverifiable)
	}
	if len(rep.Unauthenticated) != 1 || rep.Unauthenticated[0].Offset != 2 || rep.Ignored["unauthenticated"] != 1 || rep.Ignored["coverage_past_end"] != 1 {
		t.Errorf("unauthenticated %+v, ignored %v; want the record at offset 2, and one entry past the end", rep.Unauthenticated, rep.Ignored)
	}
	if rep.Head == nil || rep.Head.Offset != 4 || rep.Entries != 3 {
		t.Errorf("head %+v after %d entries; want the valid successor at offset 4, the third entry", rep.Head, rep.Entries)
	}
}

// TestCheckEvents: verify-log compares the posterior events an increment carries with those of
// its re-executed step, type by type, each naming the entry; an entry that says nothing of
// events (a build that did not record them) is not judged.
func TestCheckEvents(t *testing.T) {
	ev := func(typ string, entry int) postlog.Event {
		return postlog.Event{Key: typ, Value: []byte(fmt.Sprintf(`{"type":%q,"log_entry":%d}`, typ, entry))}
	}
	for _, tc := range []struct {
		name    string
		events  []postlog.Event
		through uint64
		want    []string
		why     string
	}{
		{"quiet step, quiet entry", nil, 6, nil, ""},
		{"an old entry says nothing", nil, 0, []string{"kl_over_budget"}, ""},
		{"held", []postlog.Event{ev("kl_over_budget", 7), ev("increment_held", 7)}, 6, []string{"kl_over_budget", "increment_held"}, ""},
		{"missing breach", nil, 6, []string{"kl_over_budget"}, "events [], the step has [kl_over_budget]"},
		{"invented breach", []postlog.Event{ev("kl_over_budget", 7)}, 6, nil, "events [kl_over_budget], the step has []"},
		{"another entry's", []postlog.Event{ev("update_failed", 5)}, 6, []string{"update_failed"}, "its update_failed event names entry 5"},
		{"not JSON", []postlog.Event{{Key: "x", Value: []byte(`"x"`)}}, 6, nil, "not JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &postlog.Entry{Kind: postlog.Increment, Seq: 7, Events: tc.events, EventsThrough: tc.through}
			why := checkEvents(e, tc.want...)
			if (tc.why == "") != (why == "") || !strings.Contains(why, tc.why) {
				t.Errorf("checkEvents = %q, want %q", why, tc.why)
			}
		})
	}
}
