package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/ledger"
)

// TestReissueQueueFullFailsInOneWrite: status changes beyond the reissue queue are not reissued;
// each gets a counterfactual_reissue_failed event, all of one call in one line of the log and
// one outbox transaction, without waiting for the queue.
func TestReissueQueueFullFailsInOneWrite(t *testing.T) {
	r := startDaemon(t, nil)
	logs := &tooltest.Output{}
	re := newReissuer(r.D, "invalidated", slog.New(slog.NewTextHandler(logs, nil))) // nothing takes from its queue
	const over = 3
	changes := make([]ledger.StatusChange, reissueQueue+over)
	for i := range changes {
		changes[i] = ledger.StatusChange{ID: fmt.Sprintf("full-%d", i), From: certify.Certified, To: certify.Invalidated, PosteriorVersion: 1}
	}
	re.notify(changes)
	if n := len(re.queue); n != reissueQueue {
		t.Fatalf("%d CEs queued, want the queue's %d", n, reissueQueue)
	}
	if n := strings.Count(logs.String(), "reissue queue full"); n != 1 || !strings.Contains(logs.String(), fmt.Sprintf("count=%d", over)) {
		t.Fatalf("the log said %d times that the queue is full, want once with count=%d:\n%s", n, over, logs.String())
	}
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.D.BrokerAddrs(), Topic: r.D.cfg.Kafka.EventsTopic, MaxWait: kafkatest.MaxWait})
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	failed := map[string]bool{}
	for len(failed) < over {
		m, err := rd.ReadMessage(ctx)
		if err != nil {
			t.Fatalf("events: %d of %d reissue failures: %v", len(failed), over, err)
		}
		var e Event
		if err := json.Unmarshal(m.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "counterfactual_reissue_failed" {
			failed[e.ID] = true
		}
	}
	for i := reissueQueue; i < len(changes); i++ {
		if !failed[changes[i].ID] {
			t.Errorf("no counterfactual_reissue_failed for %s (got %v)", changes[i].ID, failed)
		}
	}
}
