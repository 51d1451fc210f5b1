package command

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

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
