package daemon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
)

// listBenchCEs is how many CEs BenchmarkClusterList registers: about 600 a replica, so that
// each owner's page is full at the largest limit measured and the cluster's page merges three
// full pages.
const listBenchCEs = 1800

// BenchmarkClusterList measures what a page of GET /v1/counterfactuals costs on replicas against
// what it costs at one ledger, in one run. Three replicas run in one process against the
// in-process broker (as TestListsAndAuditsCoverTheCluster in daemon/internal/tests/owners starts
// them), with listBenchCEs CEs registered round-robin at the three and stored by their owners. For each limit it measures
// three ways of reading the first page at r1, one page per op:
//
//   - ledger: r1's ledger.List in process (the bbolt read the other two start from);
//   - local: GET /v1/counterfactuals?limit=N at r1 marked forwarded, answered from r1's ledger
//     alone (what each owner answers a replica that lists the cluster);
//   - cluster: the same GET unmarked: r1 asks every owner for a page (its own ledger, the two
//     others' APIs over loopback HTTP, all at once), keeps each owner's partitions and merges.
//
// Run:
//
//	go test ./daemon -run '^$' -bench ClusterList -benchtime 200x -count 5
//
// cpu-us/op is the CPU time of the whole process (replicas, broker, client) per page. local
// reports local/ledger and cluster reports cluster/local, of time and of CPU time (-cpu):
// before each op, with the timer stopped, it reads the page of the way before it (a ledger
// scan, a local page) and times that apart, so each ratio is of two ways measured alternately
// over the same seconds, whatever else the machine runs. Every page read is checked: the first
// answer to each request holds the ids expected (the first limit ids of r1's partitions, or of
// the cluster's CEs, in id order, with next the last of them), every later answer equals it
// byte for byte, and every ledger page holds r1's ids.
func BenchmarkClusterList(b *testing.B) {
	_, reps := daemontest.StartThreeReplicas(b, startNoWait)
	all := registerSpread(b, reps, listBenchCEs)
	r := reps[0]
	owned := r.D.share.Member().Owned()
	var own []string
	for _, id := range all {
		if slices.Contains(owned, ceshare.Partition(id, r.D.share.Partitions())) {
			own = append(own, id)
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	b.Cleanup(client.CloseIdleConnections)
	for _, limit := range []int{50, 500} {
		if len(own) < limit {
			b.Fatalf("r1 owns %d of the %d CEs: a local page of %d would not be full", len(own), len(all), limit)
		}
		scan := func() error { return ledgerPage(r, limit, own[:limit]) }
		local := (&pageRead{client: client, base: r.Base, limit: limit, forwarded: true, want: own[:limit]}).read
		cluster := (&pageRead{client: client, base: r.Base, limit: limit, want: all[:limit]}).read
		b.Run(fmt.Sprintf("limit=%d/ledger", limit), func(b *testing.B) { alternate(b, scan, nil, "") })
		b.Run(fmt.Sprintf("limit=%d/local", limit), func(b *testing.B) { alternate(b, local, scan, "local/ledger") })
		b.Run(fmt.Sprintf("limit=%d/cluster", limit), func(b *testing.B) { alternate(b, cluster, local, "cluster/local") })
	}
}

// alternate times op b.N times and reports the CPU time the process (the three replicas, the
// broker and the client) spent while it ran, per op. With a reference ref, it runs ref before
// each op with the timer stopped, times it apart, and reports op's time over ref's as unit and
// op's CPU time over ref's as unit-cpu.
func alternate(b *testing.B, op, ref func() error, unit string) {
	var refTime, refCPU, opCPU time.Duration
	for b.Loop() {
		if ref != nil {
			b.StopTimer()
			t0, c0 := time.Now(), processCPU(b)
			if err := ref(); err != nil {
				b.Fatal(err)
			}
			refTime += time.Since(t0)
			refCPU += processCPU(b) - c0
			b.StartTimer()
		}
		c0 := processCPU(b)
		if err := op(); err != nil {
			b.Fatal(err)
		}
		opCPU += processCPU(b) - c0
	}
	b.ReportMetric(float64(opCPU.Nanoseconds())/1e3/float64(b.N), "cpu-us/op")
	if ref != nil {
		b.ReportMetric(float64(b.Elapsed())/float64(refTime), unit)
		b.ReportMetric(float64(opCPU)/float64(refCPU), unit+"-cpu")
	}
}

// ledgerPage lists the first limit CEs of r's ledger and fails unless they are want.
func ledgerPage(r *running, limit int, want []string) error {
	ces, err := r.D.ledger.List(0, limit, "")
	if err != nil {
		return err
	}
	if len(ces) != len(want) {
		return fmt.Errorf("r1's ledger listed %d CEs, want %d", len(ces), len(want))
	}
	for i, ce := range ces {
		if ce.ID != want[i] {
			return fmt.Errorf("r1's ledger listed %s at %d, want %s", ce.ID, i, want[i])
		}
	}
	return nil
}

// pageRead reads the first page of limit CEs at base, forwarded (from the ledger there) or
// not (the cluster's). Its first answer must list want with next the last of them; every
// later answer must equal the first.
type pageRead struct {
	client    *http.Client
	base      string
	limit     int
	forwarded bool
	want      []string
	first     []byte
}

func (p *pageRead) read() error {
	url := p.base + "/v1/counterfactuals?limit=" + strconv.Itoa(p.limit)
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if p.forwarded {
		req.Header.Set(cluster.HeaderForwarded, "bench")
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s (forwarded %v): %d %s", url, p.forwarded, resp.StatusCode, body)
	}
	if p.first != nil {
		if !bytes.Equal(body, p.first) {
			return fmt.Errorf("GET %s (forwarded %v) answered another page than its first: %.300s", url, p.forwarded, body)
		}
		return nil
	}
	var page struct {
		CEs []struct {
			ID string `json:"id"`
		} `json:"counterfactuals"`
		Next string `json:"next"`
	}
	if err := json.Unmarshal(body, &page); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	var ids []string
	for _, ce := range page.CEs {
		ids = append(ids, ce.ID)
	}
	if last := p.want[len(p.want)-1]; !slices.Equal(ids, p.want) || page.Next != last {
		return fmt.Errorf("GET %s (forwarded %v) listed %v next %q; want %v next %q", url, p.forwarded, ids, page.Next, p.want, last)
	}
	p.first = body
	return nil
}

// registerSpread registers n CEs with ids ce-00000... round-robin at the replicas, from 16
// concurrent clients (the candidate pairs of daemontest.RegisterCEs, reused in turn), and returns their
// ids in id order. Each is stored by its owner when its registration is answered.
func registerSpread(b *testing.B, reps []*running, n int) []string {
	b.Helper()
	data := daemontest.Bundled(b)
	_, xs, cfs := daemontest.CandidatePairs(b, reps[0].D.current(), data, 400, 1)
	if len(xs) == 0 || len(cfs) == 0 {
		b.Fatalf("no candidate pairs: %d x, %d x_cf", len(xs), len(cfs))
	}
	ids := make([]string, n)
	for k := range ids {
		ids[k] = fmt.Sprintf("ce-%05d", k)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	defer client.CloseIdleConnections()
	var (
		next     atomic.Int64
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	t0 := time.Now()
	for range 16 {
		wg.Go(func() {
			for k := int(next.Add(1)) - 1; k < n; k = int(next.Add(1)) - 1 {
				body, _ := json.Marshal(map[string]any{"id": ids[k], "x": data.X[xs[k%len(xs)]],
					"x_cf": data.X[cfs[(k/len(xs)+k)%len(cfs)]], "target": "benign"})
				if err := postCE(client, reps[k%len(reps)].Base, body); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("register %s at r%d: %w", ids[k], k%len(reps)+1, err)
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	b.Logf("registered %d CEs at %d replicas in %v", n, len(reps), time.Since(t0).Round(time.Millisecond))
	return ids
}

// postCE posts one registration to the API at base and fails unless it is created.
func postCE(client *http.Client, base string, body []byte) error {
	resp, err := client.Post(base+"/v1/counterfactuals", "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("%d %s", resp.StatusCode, bytes.TrimSpace(msg))
	}
	return nil
}
