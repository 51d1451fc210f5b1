package stream

import (
	"os"
	"strings"
	"testing"
)

// TestOperationsListsEveryReason: docs/OPERATIONS.md's table of dead-letter reasons has a row for
// every reason code a dead letter can carry, and no other.
func TestOperationsListsEveryReason(t *testing.T) {
	raw, err := os.ReadFile("../docs/OPERATIONS.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]bool{}
	for _, line := range strings.Split(string(raw), "\n") {
		if code, ok := strings.CutPrefix(line, "| `"); ok {
			if i := strings.Index(code, "` |"); i > 0 {
				rows[code[:i]] = true
			}
		}
	}
	for _, r := range Reasons() {
		if !rows[r] {
			t.Errorf("docs/OPERATIONS.md has no row for the dead-letter reason %q", r)
		}
		delete(rows, r)
	}
	for r := range rows {
		t.Errorf("docs/OPERATIONS.md has a row for %q, which is no dead-letter reason", r)
	}
}
