package ceshare

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

// benchStates is how many states one partition of the CE state topic holds in
// BenchmarkClaimAtAcquisition (a partition of a 48,000-CE deployment of 12 partitions), and
// benchStateBytes the size of each state's CE.
const benchStates, benchStateBytes = 4000, 2048

// BenchmarkClaimAtAcquisition measures acquiring a partition whose state partition holds
// benchStates states: claiming it as a rebuild does (every state authenticated and decoded, the
// claims folded), claiming it as a partition acquired at its end does (the claims only), and,
// as the floor, a plain kafka-go read of the same records that decodes nothing.
func BenchmarkClaimAtAcquisition(b *testing.B) {
	_, conn := startBroker(b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	sw, cl := stateTopics(ctx, b, conn)
	pad := strings.Repeat("x", benchStateBytes)
	var states []State
	for i := 0; len(states) < benchStates; i++ {
		if id := fmt.Sprintf("ce-%d", i); Partition(id, testPartitions) == 0 {
			states = append(states, State{ID: id, Replica: "r1", Generation: 1, CE: json.RawMessage(fmt.Sprintf(`{"i":%d,"pad":%q}`, i, pad))})
		}
	}
	if err := sw.Write(ctx, states); err != nil {
		b.Fatal(err)
	}
	cfg := memberConfig(conn, "r1")
	cfg.StateTopic = testStateTopic
	m, err := NewMember(ctx, cfg, newLedger(), testLog(b))
	if err != nil {
		b.Fatal(err)
	}
	for _, bc := range []struct {
		name    string
		restore bool
	}{{"restoring", true}, {"at_the_end", false}} {
		b.Run(bc.name, func(b *testing.B) {
			for b.Loop() {
				got, _, err := m.claimStates(ctx, cl, 0, 1, bc.restore, false, false)
				if err != nil {
					b.Fatal(err)
				}
				if bc.restore && len(got) != benchStates {
					b.Fatalf("%d states, want %d", len(got), benchStates)
				}
			}
		})
	}
	b.Run("plain_read", func(b *testing.B) {
		for b.Loop() {
			n := 0
			for next := int64(0); ; {
				fr, err := cl.Fetch(ctx, &kafka.FetchRequest{Topic: testStateTopic, Partition: 0, Offset: next,
					MinBytes: 1, MaxBytes: int64(m.cfg.FetchMaxBytes), MaxWait: m.cfg.FetchWait})
				if err == nil && fr.Error != nil {
					err = fr.Error
				}
				if err != nil {
					b.Fatal(err)
				}
				at := next
				for {
					r, err := fr.Records.ReadRecord()
					if err != nil {
						break
					}
					if r.Offset >= next {
						next, n = r.Offset+1, n+1
					}
				}
				if next == at || next >= fr.HighWatermark {
					break
				}
			}
			if n < benchStates {
				b.Fatalf("read %d records, want at least %d", n, benchStates)
			}
		}
	})
}
