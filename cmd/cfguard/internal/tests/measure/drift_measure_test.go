package measure

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestMeasureDrift measures, end to end, what a drift over the stored CEs costs a daemon's
// increments. For n CEs (10^5; 10^6 with CFGUARD_BENCH_1M=1) put into a fresh ledger
// (fillLedger), it starts the `cfguard run` binary (`go build`) on a copy of that state directory,
// pinned to both cores (audit.workers 2: two confirmer lanes), with the embedded broker on
// loopback, and produces the data set's records, 16 every 40 ms:
//
//   - steady: with their labels (the model learns what it knows), for driftSteady increments;
//   - drift: with every label flipped (the model learns the opposite), until at least 90% of the
//     stored CEs are at_risk or invalidated (their certificates lapsed and Monte-Carlo found them
//     outside their set: a lapse alone happens in the steady phase too, and is renewed), then for
//     driftAfter increments more, at most driftMax increments in all.
//
// An increment's time is the daemon's own ("increment applied" took: the update and the ledger's
// commit, waiting for the writer lock included). It reports per phase the mean and median
// increment, the slowest, and the records per increment, the drift's mean over the steady one
// (the goal: <= 2), the share of CEs the drift moved, the file's growth and peak RSS. With
// CFGUARD_DRIFT_BASELINE=<a cfguard binary> the same run is made with that binary too, on a copy
// of the same state directory, alternated with this one (two rounds of each; one at 10^6). It runs real processes
// for minutes, so `go test ./...` skips it:
//
//	CFGUARD_MEASURE_DRIFT=1 go test ./cmd/cfguard/... -run TestMeasureDrift -v -timeout 3h
func TestMeasureDrift(t *testing.T) {
	taskset := requireTwoCoreMeasure(t, "CFGUARD_MEASURE_DRIFT", "daemon increments under a drift")
	sizes := []int{100_000}
	if os.Getenv("CFGUARD_BENCH_1M") == "1" {
		sizes = []int{1_000_000}
	}
	root := t.TempDir()
	set, _, modelDir := proc.TrainModel(t, root)
	bins := []scaleBuild{{"this", filepath.Join(root, "cfguard")}}
	if out, err := exec.Command("go", "build", "-o", bins[0].path, "github.com/cfguard/cfguard/cmd/cfguard").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if b := os.Getenv("CFGUARD_DRIFT_BASELINE"); b != "" {
		bins = append(bins, scaleBuild{"baseline", b})
	}
	for _, n := range sizes {
		dir := filepath.Join(root, fmt.Sprintf("n%d", n))
		cfg := driftConfig(t, dir, modelDir)
		first := startScaleProc(t, taskset, bins[0].path, cfg, "0,1")
		first.waitReady(t)
		first.Stop(t)
		state := filepath.Join(dir, "state")
		fillLedger(t, state, set, n)
		pristine := filepath.Join(dir, "pristine")
		copyDir(t, state, pristine)
		rounds := 2
		if n >= 1_000_000 {
			rounds = 1
		}
		for round := range rounds {
			for _, b := range bins {
				if err := os.RemoveAll(state); err != nil {
					t.Fatal(err)
				}
				copyDir(t, pristine, state)
				r := measureDrift(t, taskset, b.path, cfg, set, n)
				r.build, r.round = b.name, round
				t.Logf("%s", r)
			}
		}
	}
}

const (
	driftSteady = 100  // increments of the steady phase
	driftAfter  = 100  // increments of the drift phase after 90% of the CEs moved
	driftMax    = 2000 // increments of the drift phase at most
)

// driftConfig is scaleConfig (1000 draws, two audit workers) with JSON logs, which the
// measurement reads each increment's time from.
func driftConfig(t *testing.T, dir, modelDir string) string {
	t.Helper()
	p := scaleConfig(t, dir, modelDir, 1000, 2)
	raw, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	cfg := strings.Replace(string(raw), "  level: info\n", "  level: info\n  format: json\n", 1)
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	if out, err := exec.Command("cp", "-a", from, to).CombinedOutput(); err != nil {
		t.Fatalf("cp -a %s %s: %v\n%s", from, to, err, out)
	}
}

// driftRow is one run of TestMeasureDrift.
type driftRow struct {
	build            string
	round, n         int
	steady, drift    phaseStats
	moved            float64 // the share of CEs at_risk or invalidated when the drift phase ended
	movedAt          int     // the drift increment at which 90% had moved (0: never)
	fileMB, growthMB float64
	peakMB           float64
}

func (r driftRow) String() string {
	at := fmt.Sprintf("90%% at drift increment %d", r.movedAt)
	if r.movedAt == 0 {
		at = "90% not reached"
	}
	return fmt.Sprintf("%s round %d, %d CEs: steady %s; drift %s; drift/steady mean %.2fx, median %.2fx; "+
		"at_risk or invalidated %.1f%% (%s); file %.1f MB (+%.1f MB); peak RSS %.0f MB",
		r.build, r.round, r.n, r.steady, r.drift, r.drift.mean/r.steady.mean, r.drift.median/r.steady.median,
		100*r.moved, at, r.fileMB, r.growthMB, r.peakMB)
}

// phaseStats summarises the increments of one phase (times in ms).
type phaseStats struct {
	n                 int
	mean, median, max float64
	records           float64 // per increment
}

func (s phaseStats) String() string {
	return fmt.Sprintf("%d increments, mean %.1f ms, median %.1f ms, slowest %.0f ms, %.0f records each", s.n, s.mean, s.median, s.max, s.records)
}

// increment is one "increment applied" log line.
type increment struct {
	took    time.Duration
	records int
}

// increments parses the "increment applied" lines of a JSON log.
func increments(log string) []increment {
	var out []increment
	log = log[:strings.LastIndexByte(log, '\n')+1]
	for _, line := range strings.Split(log, "\n") {
		if !strings.Contains(line, `"increment applied"`) {
			continue
		}
		var rec struct {
			Msg     string `json:"msg"`
			Took    int64  `json:"took"`
			Records int    `json:"records"`
		}
		if json.Unmarshal([]byte(line), &rec) == nil && rec.Msg == "increment applied" {
			out = append(out, increment{time.Duration(rec.Took), rec.Records})
		}
	}
	return out
}

func summarize(incs []increment) phaseStats {
	s := phaseStats{n: len(incs)}
	if len(incs) == 0 {
		return s
	}
	ms := make([]float64, len(incs))
	for i, in := range incs {
		ms[i] = float64(in.took.Microseconds()) / 1e3
		s.mean += ms[i] / float64(len(incs))
		s.records += float64(in.records) / float64(len(incs))
	}
	slices.Sort(ms)
	s.median, s.max = ms[len(ms)/2], ms[len(ms)-1]
	return s
}

func measureDrift(t *testing.T, taskset, bin, cfg string, set *dataset.Set, n int) driftRow {
	t.Helper()
	db := filepath.Join(filepath.Dir(cfg), "state", ledger.FileName)
	size0 := fileSize(t, db)
	p := startScaleProc(t, taskset, bin, cfg, "0,1")
	p.waitReady(t)
	brokers := strings.Split(p.Log.Logged("Kafka-protocol broker started", "addrs"), ",")
	if brokers[0] == "" {
		t.Fatalf("no broker address logged:\n%s", p.Log.String())
	}
	count := func() int { return len(increments(p.Log.String())) }

	s := proc.StartStreamFlip(brokers, set, false, 40*time.Millisecond)
	waitfor.Cond(t, 10*time.Minute, fmt.Sprintf("%d steady increments", driftSteady), func() bool { return count() >= driftSteady })
	s.End(t)
	from := count()
	d := proc.StartStreamFlip(brokers, set, true, 40*time.Millisecond)
	row := driftRow{n: n}
	waitfor.Cond(t, 2*time.Hour, "the drift phase", func() bool {
		k := count() - from
		if row.movedAt == 0 {
			if row.moved = movedShare(t, p.Addr(), n); row.moved >= 0.9 {
				row.movedAt = max(k, 1)
			}
		}
		return row.movedAt > 0 && k >= row.movedAt+driftAfter || k >= driftMax
	})
	d.End(t)
	row.moved = movedShare(t, p.Addr(), n)
	all := increments(p.Log.String())
	row.steady, row.drift = summarize(all[min(10, from):from]), summarize(all[from:])
	row.peakMB = p.status(t)["VmHWM"]
	p.Stop(t)
	size := fileSize(t, db)
	row.fileMB, row.growthMB = float64(size)/1e6, float64(size-size0)/1e6
	return row
}

// movedShare reads /metrics: the share of the n stored CEs that are at_risk or invalidated.
func movedShare(t *testing.T, addr string, n int) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	moved := 0.0
	for _, line := range strings.Split(string(raw), "\n") {
		name, v, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		switch name {
		case `cfguard_counterfactuals{status="at_risk"}`, `cfguard_counterfactuals{status="invalidated"}`:
			x, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("metrics line %q: %v", line, err)
			}
			moved += x
		}
	}
	return moved / float64(n)
}
