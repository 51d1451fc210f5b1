package serving

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/ledger"
)

// Registrations from 16 concurrent clients are each answered with their own CE, and all stored.
func TestConcurrentRegistrationsOverHTTP(t *testing.T) {
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.Posterior(), data, 400, 1)
	const clients, each = 16, 8
	var wg sync.WaitGroup
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := 0; k < each; k++ {
				id := fmt.Sprintf("c%d-%d", c, k)
				req := map[string]any{"id": id, "x": data.X[xs[(c+k)%len(xs)]], "x_cf": data.X[cfs[(c*each+k)%len(cfs)]], "target": "benign"}
				code, body := r.Do(t, "POST", "/v1/counterfactuals", "", req)
				var ce ledger.CE
				if code != http.StatusCreated || json.Unmarshal(body, &ce) != nil || ce.ID != id {
					t.Errorf("register %s: %d %s", id, code, body)
				}
			}
		}()
	}
	wg.Wait()
	if n, err := r.D.Ledger().Counts(); err != nil || n[certify.Certified] != clients*each {
		t.Errorf("counts %v, %v; want %d certified", n, err, clients*each)
	}
	writes, stored := r.RegistrationBatches(t)
	if stored != clients*each {
		t.Errorf("the batch histogram counts %v CEs stored, want %d", stored, clients*each)
	}
	t.Logf("%d registrations from %d clients in %d ledger writes", clients*each, clients, writes)
}
