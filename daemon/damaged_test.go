package daemon

import (
	"testing"
)

// Server errors never carry server paths: a damaged ledger's message keeps the file's name only.
func TestServerErrorBodiesCarryNoPaths(t *testing.T) {
	for msg, want := range map[string]string{
		"ledger corrupt: /var/lib/cfguard/cfguard.db: bad. (mv /var/lib/cfguard/cfguard.db /var/lib/cfguard/cfguard.db.damaged)": "ledger corrupt: cfguard.db: bad. (mv cfguard.db cfguard.db.damaged)",
		`open "/srv/state/x.json": no such file`:                           `open "x.json": no such file`,
		"see http://example.org/a/b and 1/2":                               "see http://example.org/a/b and 1/2",
		"cannot be written (see /readyz): /srv/state/cfguard.db: no space": "cannot be written (see /readyz): cfguard.db: no space",
		"GET /v1/audit, then /healthz.":                                    "GET /v1/audit, then /healthz.",
	} {
		if got := publicMessage(msg); got != want {
			t.Errorf("publicMessage(%q) = %q, want %q", msg, got, want)
		}
	}
}
