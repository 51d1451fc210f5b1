package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
)

// ceLines writes n counterfactual lines of the bundled data ("ce-0".."ce-{n-1}"): x rows the
// model classifies malignant, x_cf rows it classifies benign with p > 0.985.
func ceLines(t *testing.T, set *dataset.Set, xs, cfs []int, n int) []string {
	t.Helper()
	lines := make([]string, n)
	for k := range lines {
		b, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("ce-%d", k), "x": set.X[xs[k%len(xs)]], "x_cf": set.X[cfs[(7*k)%len(cfs)]], "target": "benign"})
		lines[k] = string(b)
	}
	return lines
}

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
	b := startBroker(t)
	dir := t.TempDir()
	set, m, modelDir := trainModel(t, t.TempDir())
	cfg := writeConfig(t, dir, b.Addrs()[0], anyPort, "import", modelDir)
	// Every counterfactual is stored, in its set or not, so that the good lines are known
	// without measuring them here. The daemon still measures each line's x and x_cf, in the
	// import and again in the re-run (most of the test's CPU): with the fewest draws the
	// configuration accepts, since no check here reads a measurement.
	def := config.Default().Certify
	editConfig(t, cfg, "certify:\n  samples: 400\n", fmt.Sprintf("certify:\n  samples: %d\n  uncertified: store\n",
		config.MinCertifySamples(def.Delta, def.VerdictAlpha)))
	c := startChild(t, cfg, anyPort)
	c.waitUp(t)

	xs, cfs := candidatePairs(t, m, set, 200, 0.985, 1, false)
	const n = 4000 // eight batches of 500, four pages of the list
	good := ceLines(t, set, xs, cfs, n)
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
	code, stdout, stderr := runCLI(t, "import-ces", "--config", cfg, "--url", "http://"+c.addr(), "--from", file, "--progress", "100ms", "--batch", "500")
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
	var sum importSummary
	if err := json.Unmarshal([]byte(stdout), &sum); err != nil {
		t.Fatalf("stdout %q: %v", stdout, err)
	}
	if sum.Lines != n+4 || sum.Stored != n || sum.Exists != 0 || sum.Refused != 4 {
		t.Errorf("summary %+v, want %d lines, %d stored, 4 refused", sum, n+4, n)
	}
	ids := storedIDs(t, c.addr())
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
	code, stdout, stderr = runCLI(t, "import-ces", "--config", cfg, "--url", "http://"+c.addr(), "--from", file)
	if err := json.Unmarshal([]byte(stdout), &sum); err != nil || code != 1 {
		t.Fatalf("re-run: exit %d, stdout %q: %v\n%s", code, stdout, err, stderr)
	}
	if sum.Stored != 0 || sum.Exists != n || sum.Refused != 4 {
		t.Errorf("re-run summary %+v, want 0 stored, %d existing, 4 refused", sum, n)
	}
	if ids := storedIDs(t, c.addr()); len(ids) != n {
		t.Errorf("%d CEs stored after the re-run, want %d", len(ids), n)
	}
}

// TestReadBatchesRefusesLongLinesAndGoesOn: a line over http.max_body_bytes is refused by its
// number and read past, whatever its length against the reader's buffer, and the lines after it
// are sent; blank lines are skipped, CRLF endings and a last line without a newline are read.
func TestReadBatchesRefusesLongLinesAndGoesOn(t *testing.T) {
	for _, maxBody := range []int{300, 70_000, 1 << 20} {
		t.Run(fmt.Sprint(maxBody), func(t *testing.T) {
			long := `{"id": "long", "x": [` + strings.Repeat("1,", maxBody) + `1]}`
			edge := `{"id": "edge", "pad": "` + strings.Repeat("a", maxBody-26) + `"}` // maxBody-1 bytes: fits with its newline
			over := `{"id": "over", "pad": "` + strings.Repeat("a", maxBody-25) + `"}` // maxBody bytes: does not
			if len(edge) != maxBody-1 || len(over) != maxBody {
				t.Fatalf("lines of %d and %d bytes, want %d and %d", len(edge), len(over), maxBody-1, maxBody)
			}
			lines := []string{`{"id": "a"}`, long, "", `{"id": "b"}` + "\r", edge, over, `{"id": "c"}`}
			var stderr strings.Builder
			imp := &importer{stderr: &stderr, start: time.Now()}
			out := make(chan bulkBatch, 10)
			err := readBatches(context.Background(), strings.NewReader(strings.Join(lines, "\n")), 2, maxBody, imp, out, nil)
			close(out)
			if err != nil {
				t.Fatalf("readBatches: %v", err)
			}
			var sent []int
			for b := range out {
				if len(b.body) > maxBody {
					t.Errorf("a batch of %d bytes, over %d", len(b.body), maxBody)
				}
				sent = append(sent, b.lines...)
			}
			if want := []int{1, 4, 5, 7}; !slices.Equal(sent, want) {
				t.Errorf("lines sent %v, want %v; stderr:\n%s", sent, want, stderr.String())
			}
			for _, want := range []string{
				fmt.Sprintf("line 2 refused: %d bytes, over http.max_body_bytes %d", len(long), maxBody),
				fmt.Sprintf("line 6 refused: %d bytes, over http.max_body_bytes %d", len(over), maxBody),
			} {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr lacks %q:\n%s", want, stderr.String())
				}
			}
			if s := imp.summary(); s.Lines != 6 || s.Refused != 2 {
				t.Errorf("summary %+v, want 6 lines read, 2 refused", s)
			}
		})
	}
}

// A line a replica sent to its CE's owner is counted accepted, neither stored nor existing:
// the owner stores or refuses it after the answer.
func TestImportCountsLinesAcceptedByReplicas(t *testing.T) {
	var stderr strings.Builder
	imp := &importer{stderr: &stderr, total: 4, start: time.Now()}
	body := `{"stored":1,"accepted":2,"exists":1,"refused":0,"results":[` +
		`{"line":1,"id":"a","status":"certified"},{"line":2,"id":"b","status":"accepted"},` +
		`{"line":3,"id":"c","status":"accepted"},{"line":4,"id":"d","status":"exists"}]}`
	if err := imp.record(bulkBatch{lines: []int{1, 2, 3, 4}}, []byte(body)); err != nil {
		t.Fatal(err)
	}
	if s := imp.summary(); s.Stored != 1 || s.Accepted != 2 || s.Exists != 1 || s.Refused != 0 {
		t.Errorf("summary %+v, want 1 stored, 2 accepted, 1 existing", s)
	}
	imp.progress()
	if !strings.Contains(stderr.String(), "1 stored, 2 accepted by replicas, 1 existing") {
		t.Errorf("progress line %q does not count the accepted lines", stderr.String())
	}
}
