package daemon

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// changeKey identifies one status change: consumers dedupe events by CE id and posterior
// version (and the status reached, since a verdict can follow the bound's change at the same
// version).
type changeKey struct {
	id      string
	version uint64
	to      string
}

// TestOutboxDeliversEveryStatusChangeAcrossKills streams a drift that changes the status of
// registered CEs over many increments, kills the daemon with SIGKILL at random points (some land
// between a checkpoint and the publish of its events), restarts it, and then requires every
// status change the ledger recorded to be on the events topic at least once.
func TestOutboxDeliversEveryStatusChangeAcrossKills(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills daemon processes")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := proc.StartBroker(t)
	brokerAddr := b.Addrs()[0]
	dir := t.TempDir()
	set, m, modelDir := proc.TrainModel(t, dir)
	httpAddr := proc.AnyPort
	cfg := proc.WriteConfig(t, dir, brokerAddr, httpAddr, "outbox", modelDir)
	proc.EditConfig(t, cfg, "certify:\n  samples: 400\n", "certify:\n  samples: 400\nupdate:\n  solver: adam\n  objective: prior\n  kl_weight: 0\n  memory_records: 0\n  learning_rate: 0.0005\n")

	// CEs with a spread of p1, so that the drift fails their bounds at different increments.
	c := proc.StartChild(t, cfg, httpAddr)
	c.WaitUp(t)
	xs, cfs := proc.CandidatePairs(t, m, set, 400, 0.97, 0.005, true)
	registered := 0
	for k := 0; k < min(len(xs), len(cfs), 60); k++ {
		body, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("ce-%d", k), "x": set.X[xs[k]], "x_cf": set.X[cfs[k]], "target": "benign"})
		resp, err := http.Post("http://"+c.Addr()+"/v1/counterfactuals", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusCreated {
			registered++
		}
	}
	if registered < 20 {
		t.Fatalf("only %d CEs registered", registered)
	}

	// 320 benign rows labelled malignant: 20 increments of 16 that drift steadily.
	const total = 320
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokerAddr), Topic: "cfguard.records", RequiredAcks: kafka.RequireAll, BatchSize: 100}
	var msgs []kafka.Message
	for i := 0; len(msgs) < total; i++ {
		k := i % len(set.X)
		if set.Y[k] != 1 {
			continue
		}
		v, _ := json.Marshal(map[string]any{"id": fmt.Sprint(i), "features": set.X[k], "label": "malignant"})
		msgs = append(msgs, kafka.Message{Value: v})
	}
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatal(err)
	}
	w.Close()

	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 2))
	var killAt []int64
	for k := 0; k < 5; k++ {
		killAt = append(killAt, int64(k*total/5+1+rng.IntN(total/5-1)))
	}
	t.Logf("%d CEs registered; kill thresholds %v (seed %d)", registered, killAt, seed)
	for k := 0; ; k++ {
		if k > 0 {
			c = proc.StartChild(t, cfg, httpAddr)
		}
		target := int64(total)
		if k < len(killAt) {
			target = killAt[k]
		}
		c.WaitApplied(t, target, fmt.Sprintf("restart %d", k))
		if k < len(killAt) {
			time.Sleep(time.Duration(rng.IntN(60)) * time.Millisecond)
			c.Cmd.Process.Signal(syscall.SIGKILL)
			c.Wait()
			continue
		}
		// The last run publishes what is left: outbox empty, every failing CE measured under the
		// last posterior (both read from the ledger in one transaction, so neither can change
		// behind the other's back: no measurement is left to write an event).
		// Both counts go down as the outbox publishes and the confirmer measures: 60 s without a
		// new low of either fails, a slow core does not (a count that only goes up and down is
		// no progress).
		func() {
			defer func() {
				if t.Failed() {
					t.Logf("log of the daemon:\n%s", c.Log.String())
				}
			}()
			low := []float64{math.Inf(1), math.Inf(1)}
			waitfor.Progress(t, 60*time.Second, "the outbox empty and every CE measured", func() (bool, string) {
				v := c.MetricValues("cfguard_events_pending", "cfguard_counterfactuals_unconfirmed")
				for i := range low {
					if v[i] >= 0 { // -1: the daemon did not answer
						low[i] = min(low[i], v[i])
					}
				}
				return v[0] == 0 && v[1] == 0, fmt.Sprintf("lowest outbox pending %v, unconfirmed %v", low[0], low[1])
			})
		}()
		c.Cmd.Process.Signal(syscall.SIGTERM)
		if err := c.Wait(); err != nil {
			t.Fatalf("exit after SIGTERM: %v; log:\n%s", err, c.Log.String())
		}
		break
	}

	// Every status change the ledger holds, by CE.
	l, err := ledger.Open(filepath.Join(dir, "state"), ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := l.State()
	if err != nil {
		t.Fatal(err)
	}
	want := map[changeKey]bool{}
	for after := ""; ; {
		page, err := l.List(0, 1000, after)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			break
		}
		for _, ce := range page {
			for _, h := range ce.History {
				if h.Renewal {
					continue // a renewal changes no status and publishes no event
				}
				want[changeKey{ce.ID, h.PosteriorVersion, h.To.String()}] = true
			}
		}
		after = page[len(page)-1].ID
	}
	l.Close()
	if st.Applied != total || st.OutboxLen != 0 {
		t.Fatalf("ledger after the run: applied %d (want %d), outbox %d (want 0)", st.Applied, total, st.OutboxLen)
	}
	if len(want) < 10 {
		t.Fatalf("the drift changed only %d statuses; the test needs more to show anything", len(want))
	}

	// Everything on the events topic.
	got, seqs, dups := map[changeKey]bool{}, map[uint64]bool{}, 0
	events := kafkatest.ReadPartition(t, []string{brokerAddr}, "cfguard.events", 0)
	for _, msg := range events {
		seq := ""
		for _, h := range msg.Headers {
			if h.Key == daemon.OutboxSeqHeader {
				seq = string(h.Value)
			}
		}
		n, err := strconv.ParseUint(seq, 10, 64)
		if err != nil {
			t.Fatalf("event at offset %d without a %s header: %s", msg.Offset, daemon.OutboxSeqHeader, msg.Value)
		}
		if seqs[n] {
			dups++
		}
		seqs[n] = true
		var e struct {
			Type, ID, To     string
			PosteriorVersion uint64 `json:"posterior_version"`
		}
		if err := json.Unmarshal(msg.Value, &e); err != nil {
			t.Fatal(err)
		}
		if e.Type == "status_changed" {
			got[changeKey{e.ID, e.PosteriorVersion, e.To}] = true
		}
	}
	var missing []changeKey
	for k := range want {
		if !got[k] {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		t.Fatalf("%d of %d status changes in the ledger never reached the events topic, e.g. %+v", len(missing), len(want), missing[0])
	}
	t.Logf("%d status changes in the ledger, all on the events topic (%d events, %d redelivered after kills)", len(want), len(events), dups)
}
