package serving

import (
	"bytes"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	bolt "go.etcd.io/bbolt"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/ledger"
)

// serverPath is an absolute path in a response body.
var serverPath = regexp.MustCompile(`(^|[\s("'=\[{])/[A-Za-z0-9._-]+/`)

// A CE record damaged on disk is found when the daemon starts, not when it is read: the daemon
// starts and is ready, the CE answers 500 with no server path in the body, lists and audits
// answer 200 without it, the gauge counts it and the log names it.
func TestDamagedCERecordIsQuarantinedAtStart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the daemon twice")
	}
	data := daemontest.Bundled(t)
	r := launch.Daemon(t, nil)
	dir := r.Config.StateDir
	ids := daemontest.RegisterCEs(t, r, data, 6, "")
	r.Stop(t)

	// One flipped byte in ce-3's header, the file's structure intact.
	db, err := bolt.Open(filepath.Join(dir, ledger.FileName), 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("ce_hdr"))
		v := bytes.Clone(b.Get([]byte("ce-3")))
		v[10] ^= 0x08
		return b.Put([]byte("ce-3"), v)
	})
	if cerr := db.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}

	r = launch.Daemon(t, func(c *config.Config) { c.StateDir = dir })
	code, body := r.Get(t, "/v1/counterfactuals/ce-3")
	if code != http.StatusInternalServerError || !strings.Contains(string(body), "quarantined") || serverPath.Match(body) || bytes.Contains(body, []byte(dir)) {
		t.Fatalf("GET of the damaged CE: %d %s; want 500 saying it is quarantined, with no server path", code, body)
	}
	listed := 0
	for _, st := range []string{"certified", "at_risk", "invalidated", "uncertified"} {
		code, body := r.Get(t, "/v1/counterfactuals?status="+st)
		if code != http.StatusOK || bytes.Contains(body, []byte(`"ce-3"`)) {
			t.Fatalf("GET /v1/counterfactuals?status=%s: %d %s", st, code, body)
		}
		listed += strings.Count(string(body), `"id":"ce-`)
	}
	if listed != len(ids)-1 {
		t.Fatalf("the lists hold %d CEs; want the %d undamaged ones", listed, len(ids)-1)
	}
	if code, body := r.Do(t, "POST", "/v1/audit", "", nil); code != http.StatusOK {
		t.Fatalf("POST /v1/audit: %d %s", code, body)
	}
	if got := r.Metric(t, alerts.NameDamaged); got != 1 {
		t.Fatalf("%s = %v, want 1", alerts.NameDamaged, got)
	}
	if log := r.Logs.String(); !strings.Contains(log, "id=ce-3") || !strings.Contains(log, "quarantined") {
		t.Fatalf("the log does not name the quarantined CE:\n%s", log)
	}
	// DELETE drops the damaged record, and the gauge follows.
	if code, body := r.Do(t, "DELETE", "/v1/counterfactuals/ce-3", "", nil); code/100 != 2 {
		t.Fatalf("DELETE of the quarantined CE: %d %s", code, body)
	}
	if got := r.Metric(t, alerts.NameDamaged); got != 0 {
		t.Fatalf("%s = %v after the DELETE, want 0", alerts.NameDamaged, got)
	}
}
