package measure

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMeasureImport measures the bulk path: `cfguard import-ces` of n CEs (10^5, or
// CFGUARD_IMPORT_N) into a running `cfguard run` at the default certify settings (1000 draws,
// float64), for each build (the OpenBLAS one, which the default image ships, and `go build`), each
// daemon on both cores with a fresh state directory. The lines are pairs of the bundled data set
// (x of class 0, x' of class 1 with p > 0.985), so that nearly all are stored. It reports each
// build's lines per second, the time the file took, and 10^6 lines at that rate; every line must
// be stored or refused, none lost.
//
//	CFGUARD_MEASURE_IMPORT=1 go test ./cmd/cfguard/... -run TestMeasureImport -v -timeout 1h
func TestMeasureImport(t *testing.T) {
	taskset := requireTwoCoreMeasure(t, "CFGUARD_MEASURE_IMPORT", "the bulk import into daemon processes")
	n := 100_000
	if s := os.Getenv("CFGUARD_IMPORT_N"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 1 {
			t.Fatalf("CFGUARD_IMPORT_N=%q: want a positive integer", s)
		}
		n = v
	}
	root := t.TempDir()
	set, m, modelDir := proc.TrainModel(t, root)
	builds := scaleBinaries(t, root)
	xs, cfs := proc.CandidatePairs(t, m, set, 200, 0.985, 1, false)
	file := filepath.Join(root, "ces.ndjson")
	if err := os.WriteFile(file, []byte(strings.Join(proc.CELines(t, set, xs, cfs, n), "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var table strings.Builder
	fmt.Fprintf(&table, "| build | lines | stored | refused | took | lines/s | 10^6 lines at this rate |\n|---|---|---|---|---|---|---|\n")
	for _, b := range builds {
		dir := filepath.Join(root, b.name)
		cfg := scaleConfig(t, dir, modelDir, 1000, 2)
		p := startScaleProc(t, taskset, b.path, cfg, "0,1")
		p.waitReady(t)
		cmd := exec.Command(b.path, "import-ces", "--config", cfg, "--url", "http://"+p.Addr(), "--from", file, "--progress", "30s")
		cmd.Env = append(os.Environ(), "CFGUARD_HTTP_TOKEN=")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		start := time.Now()
		out, err := cmd.Output()
		took := time.Since(start)
		var sum command.ImportSummary
		if jerr := json.Unmarshal(out, &sum); jerr != nil {
			t.Fatalf("%s: import-ces: %v; stdout %q; stderr:\n%s", b.name, err, out, stderr.String())
		}
		if sum.Lines != n || sum.Stored+sum.Exists+sum.Refused != n {
			t.Fatalf("%s: summary %+v: want %d lines, each stored or refused (stderr:\n%s)", b.name, sum, n, stderr.String())
		}
		p.Stop(t)
		t.Logf("%s: %+v in %v", b.name, sum, took.Round(time.Millisecond))
		fmt.Fprintf(&table, "| %s | %d | %d | %d | %v | %.0f | %v |\n", b.name, sum.Lines, sum.Stored, sum.Refused,
			took.Round(time.Second), sum.Rate, (time.Duration(1e6/sum.Rate) * time.Second).Round(time.Second))
	}
	t.Log("\n" + table.String())
}
