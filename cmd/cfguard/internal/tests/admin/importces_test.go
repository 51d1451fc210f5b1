package admin

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
)

// storedIDs lists every stored CE's id through the API.
func storedIDs(t *testing.T, addr string) map[string]bool {
	t.Helper()
	ids, after := map[string]bool{}, ""
	for {
		resp, err := http.Get("http://" + addr + "/v1/counterfactuals?limit=1000&after=" + after)
		if err != nil {
			t.Fatal(err)
		}
		var page struct {
			Counterfactuals []struct{ ID string }
			Next            string
		}
		err = json.NewDecoder(resp.Body).Decode(&page)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, ce := range page.Counterfactuals {
			ids[ce.ID] = true
		}
		if page.Next == "" {
			return ids
		}
		after = page.Next
	}
}

// TestImportCEsLoadsEveryGoodLine imports 4000 CEs with a few bad lines among them into a
// running daemon: each bad line is refused with its line number, every good line is stored once,
// the command exits 1 naming the count; run again, it stores nothing twice.
func TestImportCEsLoadsEveryGoodLine(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a daemon process and loads 4000 CEs")
	}
	b := proc.StartBroker(t)
	dir := t.TempDir()
	set, m, modelDir := proc.TrainModel(t, t.TempDir())
	cfg := proc.WriteConfig(t, dir, b.Addrs()[0], proc.AnyPort, "import", modelDir)
	// Every counterfactual is stored, in its set or not, so that the good lines are known
	// without measuring them here. The daemon still measures each line's x and x_cf, in the
	// import and again in the re-run (most of the test's CPU): with the fewest draws the
	// configuration accepts, since no check here reads a measurement.
	def := config.Default().Certify
	proc.EditConfig(t, cfg, "certify:\n  samples: 400\n", fmt.Sprintf("certify:\n  samples: %d\n  uncertified: store\n",
		certify.MinRenewableSamples(def.Delta, def.VerdictAlpha)))
	c := proc.StartChild(t, cfg, proc.AnyPort)
	c.WaitUp(t)

	xs, cfs := proc.CandidatePairs(t, m, set, 200, 0.985, 1, false)
	const n = 4000 // eight batches of 500, four pages of the list
	good := proc.CELines(t, set, xs, cfs, n)
	short, _ := json.Marshal(map[string]any{"id": "short", "x": []float64{1, 2, 3}, "x_cf": set.X[cfs[0]], "target": "benign"})
	// File lines: good ones, with a bad JSON line at 5, a blank line at 50 (skipped), a wrong
	// dimension at 100, a repeated id at 2000 and a line without an id at 3000.
	var lines []string
	bad := map[int]string{5: `{"id": "broken", "x": [1,`, 50: "", 100: string(short), 2000: good[0], 3000: `{"x": [1], "x_cf": [1], "target": 1}`}
	for _, g := range good {
		for {
			if l, ok := bad[len(lines)+1]; ok {
				lines = append(lines, l)
				continue
			}
			break
		}
		lines = append(lines, g)
	}
	file := filepath.Join(t.TempDir(), "ces.ndjson")
	if err := os.WriteFile(file, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	t0 := time.Now()
	code, stdout, stderr := proc.RunCLI(t, "import-ces", "--config", cfg, "--url", "http://"+c.Addr(), "--from", file, "--progress", "100ms", "--batch", "500")
	took := time.Since(t0)
	if code != 1 {
		t.Fatalf("import-ces: exit %d, want 1 (4 lines refused); stderr:\n%s", code, stderr)
	}
	for _, want := range []string{
		"line 5 refused: bad JSON",
		"line 100 refused: 400: bad request: x has 3 features",
		`line 2000 refused: id "ce-0" repeats line 1`,
		"line 3000 refused: no id",
		fmt.Sprintf("4 of %d lines refused", n+4),
		fmt.Sprintf("/%d lines (", n+4),
	} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr lacks %q:\n%s", want, stderr)
		}
	}
	if got := strings.Count(stderr, "refused: "); got != 4 {
		t.Errorf("%d refused lines reported, want 4:\n%s", got, stderr)
	}
	var sum command.ImportSummary
	if err := json.Unmarshal([]byte(stdout), &sum); err != nil {
		t.Fatalf("stdout %q: %v", stdout, err)
	}
	if sum.Lines != n+4 || sum.Stored != n || sum.Exists != 0 || sum.Refused != 4 {
		t.Errorf("summary %+v, want %d lines, %d stored, 4 refused", sum, n+4, n)
	}
	ids := storedIDs(t, c.Addr())
	for k := range n {
		if !ids[fmt.Sprintf("ce-%d", k)] {
			t.Errorf("ce-%d (a good line) is not stored", k)
		}
	}
	if len(ids) != n {
		t.Errorf("%d CEs stored, want %d", len(ids), n)
	}
	t.Logf("%d lines in %v (%.0f lines/s)", sum.Lines, took.Round(time.Millisecond), sum.Rate)

	// Again: nothing stored twice, every good line counted as existing.
	code, stdout, stderr = proc.RunCLI(t, "import-ces", "--config", cfg, "--url", "http://"+c.Addr(), "--from", file)
	if err := json.Unmarshal([]byte(stdout), &sum); err != nil || code != 1 {
		t.Fatalf("re-run: exit %d, stdout %q: %v\n%s", code, stdout, err, stderr)
	}
	if sum.Stored != 0 || sum.Exists != n || sum.Refused != 4 {
		t.Errorf("re-run summary %+v, want 0 stored, %d existing, 4 refused", sum, n)
	}
	if ids := storedIDs(t, c.Addr()); len(ids) != n {
		t.Errorf("%d CEs stored after the re-run, want %d", len(ids), n)
	}
}
