package replicas

import (
	"encoding/json"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// paperLearner is the replicas' configuration of a learner that follows a drift within a few
// increments (daemontest.PaperLearner).
const paperLearner = `update:
  solver: adam
  objective: prior
  kl_weight: 0
  memory_records: 0
  learning_rate: 0.003
`

// ceEvent is what these tests read of an event of the events topic.
type ceEvent struct {
	Type    string    `json:"type"`
	ID      string    `json:"id"`
	From    string    `json:"from"`
	To      string    `json:"to"`
	Version uint64    `json:"posterior_version"`
	At      time.Time `json:"at"`
	Replica string    `json:"-"`
}

// eventsSince reads the events topic's partitions past the offsets in from (the count of
// messages read of each before), and returns the events with the replica that published them
// and the new counts.
func eventsSince(t *testing.T, brokers []string, from []int) ([]ceEvent, []int) {
	t.Helper()
	var out []ceEvent
	next := slices.Clone(from)
	for p := range next {
		msgs := kafkatest.ReadPartition(t, brokers, "cfguard.events", p)
		for _, m := range msgs[next[p]:] {
			var e ceEvent
			if err := json.Unmarshal(m.Value, &e); err != nil {
				t.Fatalf("events partition %d offset %d: %v", p, m.Offset, err)
			}
			e.Replica = kafkatest.Header(m, "cfguard-replica")
			out = append(out, e)
		}
		next[p] = len(msgs)
	}
	return out, next
}

// An owner paused past its session (SIGSTOP) while another replica takes over its partitions
// and judges a drift publishes nothing for those partitions once it resumes (SIGCONT): r1 and r2
// share the CEs, r1 is stopped until r2 owns every partition, a drift applied meanwhile changes
// statuses of r1's CEs at r2, and r1 continues. No event r1 publishes after it continues
// names a CE of a partition r2 took over during the pause, unless r1 took that partition back
// (with r2's states).
func TestPausedOwnerPublishesNothingForPartitionsItLost(t *testing.T) {
	if testing.Short() {
		t.Skip("two replica processes, a pause and a drift: not with -short")
	}
	root := t.TempDir()
	data, model, modelDir := proc.TrainModel(t, root)
	brokers := proc.StartClusterBroker(t)
	reps := proc.StartReplicas(t, root, 2, brokers, modelDir, paperLearner)
	r1, r2 := reps[0], reps[1]
	ids := registerRoundRobin(t, reps, data, model, 24)
	const parts = 12 // replication.ce_partitions' default
	var kept []int
	waitfor.Cond(t, 60*time.Second, "the partitions shared by r1 and r2", func() bool {
		p1, ok1 := r1.CEPartitions()
		p2, ok2 := r2.CEPartitions()
		kept = p1
		return ok1 && ok2 && len(p1) > 0 && len(p1)+len(p2) == parts && r1.Ready() && r2.Ready()
	})
	held := 0
	for _, id := range ids {
		if slices.Contains(kept, ceshare.Partition(id, parts)) {
			held++
		}
	}
	_, offs := eventsSince(t, brokers, make([]int, 3))

	paused := time.Now()
	r1.Signal(t, syscall.SIGSTOP)
	waitfor.Cond(t, 3*proc.ReplicaSession+30*time.Second, "r2 owning every partition, ready", func() bool {
		p2, ok := r2.CEPartitions()
		return ok && len(p2) == parts && r2.Ready()
	})
	took := time.Since(paused)

	// The drift: records with every label flipped, until r2 has published a status change of a
	// CE r1 held.
	d := proc.StartStreamFlip(brokers, data, true, proc.StreamEvery)
	byR2 := map[string]ceEvent{}
	waitfor.Cond(t, 3*time.Minute, "r2's status change of a CE r1 held", func() bool {
		var evs []ceEvent
		evs, offs = eventsSince(t, brokers, offs)
		for _, e := range evs {
			if e.Type == "status_changed" && e.Replica == "r2" && slices.Contains(kept, ceshare.Partition(e.ID, parts)) {
				byR2[fmt.Sprintf("%s %s->%s", e.ID, e.From, e.To)] = e
			}
		}
		return len(byR2) > 0
	})
	d.End(t)
	waitfor.Cond(t, 60*time.Second, "r2's outbox drained", func() bool {
		v, ok := r2.Metric("cfguard_events_pending")
		return ok && v == 0
	})
	_, offs = eventsSince(t, brokers, offs)
	stopped := time.Since(paused)
	r1.Signal(t, syscall.SIGCONT)
	resumed := time.Now()

	var back []int // the partitions r1 owns again, with r2's states
	waitfor.Cond(t, 90*time.Second, "r1 and r2 sharing the partitions again, r1's outbox drained", func() bool {
		p1, ok1 := r1.CEPartitions()
		p2, ok2 := r2.CEPartitions()
		v, ok := r1.Metric("cfguard_events_pending")
		back = p1
		return ok1 && ok2 && len(p1) > 0 && len(p1)+len(p2) == parts && ok && v == 0 && r1.Ready()
	})
	after, _ := eventsSince(t, brokers, offs)
	stale := 0
	for _, e := range after {
		if p := ceshare.Partition(e.ID, parts); e.Replica != "r1" || e.ID == "" || !slices.Contains(kept, p) || slices.Contains(back, p) {
			continue
		}
		stale++
		_, again := byR2[fmt.Sprintf("%s %s->%s", e.ID, e.From, e.To)]
		t.Errorf("r1 published %s of %s (%s -> %s, a change r2 published while r1 was stopped: %v) at posterior version %d "+
			"(at %s, %s after SIGCONT), whose partition r2 took over while r1 was stopped",
			e.Type, e.ID, e.From, e.To, again, e.Version, e.At.Format(time.RFC3339Nano), e.At.Sub(resumed).Round(time.Millisecond))
	}
	t.Logf("r1 held partitions %v (%d of %d CEs); r2 owned every partition %v after SIGSTOP; r1 continued after %v; "+
		"r2 published %d status changes of r1's CEs; after SIGCONT r1 owns %v and published %d events, %d of them for CEs r2 took over",
		kept, held, len(ids), took.Round(time.Millisecond), stopped.Round(time.Millisecond), len(byR2), back, countBy(after, "r1"), stale)
}

func countBy(evs []ceEvent, replica string) int {
	n := 0
	for _, e := range evs {
		if e.Replica == replica {
			n++
		}
	}
	return n
}
