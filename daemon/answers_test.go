package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// startThreeReplicas starts replicas r1, r2, r3 on one broker and waits until the CE topic's
// partitions are shared out among them, each owner caught up with its partitions.
func startThreeReplicas(t *testing.T) (*broker.Broker, []*running) {
	t.Helper()
	b := startCluster(t, 1)
	reps := []*running{startReplica(t, b, "r1"), startReplica(t, b, "r2"), startReplica(t, b, "r3")}
	parts := reps[0].d.rep.share.partitions
	waitfor.Cond(t, 90*time.Second, "every CE partition owned by one ready replica, each replica owning some", func() bool {
		owned := 0
		for _, r := range reps {
			m := r.d.rep.share.member
			own := m.Owned()
			if len(own) == 0 {
				return false
			}
			for _, p := range own {
				if !m.Ready(p) {
					return false
				}
			}
			owned += len(own)
		}
		return owned == parts
	})
	return b, reps
}

// settled waits until the owner of id's CE partition has applied every request the partition
// holds, and returns what that owner stores under id (nil when nothing).
func settled(t *testing.T, b *broker.Broker, reps []*running, id string) *ledger.CE {
	t.Helper()
	s := reps[0].d.rep.share
	p := ceshare.Partition(id, s.partitions)
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...)}
	var owner *running
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d applied to its end by its owner", p), func() bool {
		res, err := cl.ListOffsets(context.Background(), &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
			reps[0].d.cfg.Replication.CETopic: {kafka.LastOffsetOf(p)}}})
		if err != nil {
			return false
		}
		var end int64 = -1
		for _, po := range res.Topics[reps[0].d.cfg.Replication.CETopic] {
			if po.Partition == p && po.Error == nil {
				end = po.LastOffset
			}
		}
		for _, r := range reps {
			m := r.d.rep.share.member
			if next, ok := m.Next(p); ok && m.Ready(p) && next >= end && end >= 0 {
				owner = r
				return true
			}
		}
		return false
	})
	ce, err := owner.d.ledger.Get(id)
	if err != nil {
		return nil
	}
	return ce
}

// TestRegistrationAfterDeletionAnswersWhatIsStored registers A at one replica, deletes it at
// another and registers B under the same id at a third, many times: each answer to B must say
// what the owner stores once every request of the partition is applied: 201 when it stores B,
// 409 only when it stores another CE under the id. The deletion's answer comes before its owner
// applies it, so the third replica's answer must come from the partition's order, not from
// what the owner happened to hold when it was asked.
func TestRegistrationAfterDeletionAnswersWhatIsStored(t *testing.T) {
	if testing.Short() {
		t.Skip("three replicas: not with -short")
	}
	b, reps := startThreeReplicas(t)
	data := bundled(t)
	_, xs, cfs := candidatePairs(t, reps[0].d.current(), data, 400, 1)
	if len(xs) < 2 || len(cfs) < 2 {
		t.Fatalf("too few candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	ceA := map[string]any{"x": data.X[xs[0]], "x_cf": data.X[cfs[0]], "target": "benign"}
	ceB := map[string]any{"x": data.X[xs[1]], "x_cf": data.X[cfs[1]], "target": "benign"}
	with := func(ce map[string]any, id string) map[string]any {
		out := map[string]any{"id": id}
		for k, v := range ce {
			out[k] = v
		}
		return out
	}
	const trials = 50
	answers := map[int]int{}
	for i := range trials {
		id := fmt.Sprintf("attack-%d", i)
		if code, body := reps[0].do(t, "POST", "/v1/counterfactuals", "", with(ceA, id)); code != http.StatusCreated {
			t.Fatalf("trial %d: POST A at r1: %d %s", i, code, body)
		}
		if code, body := reps[1].do(t, "DELETE", "/v1/counterfactuals/"+id, "", nil); code != http.StatusNoContent {
			t.Fatalf("trial %d: DELETE at r2: %d %s", i, code, body)
		}
		code, body := reps[2].do(t, "POST", "/v1/counterfactuals", "", with(ceB, id))
		answers[code]++
		stored := settled(t, b, reps, id)
		isB := stored != nil && slices.Equal(stored.X, data.X[xs[1]]) && slices.Equal(stored.XCF, data.X[cfs[1]])
		switch code {
		case http.StatusCreated:
			if !isB {
				t.Errorf("trial %d: POST B answered 201, and the owner stores %v", i, describe(stored))
			}
			var got ledger.CE
			if err := json.Unmarshal(body, &got); err != nil || got.ID != id || !slices.Equal(got.XCF, data.X[cfs[1]]) {
				t.Errorf("trial %d: POST B answered 201 with %s", i, body)
			}
		case http.StatusConflict:
			if isB || stored == nil {
				t.Errorf("trial %d: POST B answered 409 %s, and the owner stores %v", i, body, describe(stored))
			}
		default:
			t.Errorf("trial %d: POST B answered %d %s", i, code, body)
		}
		// Every replica serves what the owner stores.
		for _, r := range reps {
			code, got := r.get(t, "/v1/counterfactuals/"+id)
			if (code == http.StatusOK) != (stored != nil) {
				t.Errorf("trial %d: GET at %s: %d %s; the owner stores %v", i, r.d.rep.share.id, code, got, describe(stored))
			}
		}
	}
	t.Logf("answers to POST B over %d trials: %v", trials, answers)
}

// describe names a stored CE in a test message.
func describe(ce *ledger.CE) string {
	if ce == nil {
		return "nothing"
	}
	return fmt.Sprintf("%s (x_cf[0] = %v, %v)", ce.ID, ce.XCF[0], ce.Status)
}
