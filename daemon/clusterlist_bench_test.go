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
)

// listBenchCEs is how many CEs BenchmarkClusterList registers: about 600 a replica, so that
// each owner's page is full at the largest limit measured and the cluster's page merges three
// full pages.
const listBenchCEs = 1800

// BenchmarkClusterList measures what a page of GET /v1/counterfactuals costs on replicas against
// what it costs at one ledger, in one run. Three replicas run in one process against the
// in-process broker (as TestListsAndAuditsCoverTheCluster starts them), with listBenchCEs CEs
// registered round-robin at the three and stored by their owners. For each limit it measures
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
// local reports local/ledger and cluster reports cluster/local: its ns/op over the median
// ns/op of the sub-benchmark before it (the runs with the largest b.N), so with -count each
// run's ratio shows that run's spread against the median of the other's. Every page read is
// checked: the first answer of a run holds the ids expected (the first limit ids of r1's
// partitions, or of the cluster, in id order, and next after the last), and every later answer
// equals it byte for byte; every ledger page holds the expected ids.
func BenchmarkClusterList(b *testing.B) {
	_, reps := startThreeReplicas(b)
	all := registerSpread(b, reps, listBenchCEs)
	r := reps[0]
	owned := r.d.share.member.Owned()
	var own []string
	for _, id := range all {
		if slices.Contains(owned, ceshare.Partition(id, r.d.share.partitions)) {
			own = append(own, id)
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	b.Cleanup(client.CloseIdleConnections)
	for _, limit := range []int{50, 500} {
		if len(own) < limit {
			b.Fatalf("r1 owns %d of the %d CEs: a local page of %d would not be full", len(own), len(all), limit)
		}
		wantLocal, wantCluster := own[:limit], all[:limit]
		var ledgerNs, localNs benchRuns
		b.Run(fmt.Sprintf("limit=%d/ledger", limit), func(b *testing.B) {
			for b.Loop() {
				ces, err := r.d.ledger.List(0, limit, "")
				if err != nil {
					b.Fatal(err)
				}
				if len(ces) != len(wantLocal) {
					b.Fatalf("r1's ledger listed %d CEs, want %d", len(ces), len(wantLocal))
				}
				for i, ce := range ces {
					if ce.ID != wantLocal[i] {
						b.Fatalf("r1's ledger listed %s at %d, want %s", ce.ID, i, wantLocal[i])
					}
				}
			}
			ledgerNs.add(b)
		})
		b.Run(fmt.Sprintf("limit=%d/local", limit), func(b *testing.B) {
			pageLoop(b, client, r.base, limit, true, wantLocal)
			localNs.add(b)
			if len(ledgerNs) > 0 { // not when -bench selects this sub-benchmark alone
				b.ReportMetric(localNs.last()/ledgerNs.median(), "local/ledger")
			}
		})
		b.Run(fmt.Sprintf("limit=%d/cluster", limit), func(b *testing.B) {
			pageLoop(b, client, r.base, limit, false, wantCluster)
			var mine benchRuns
			mine.add(b)
			if len(localNs) > 0 {
				b.ReportMetric(mine.last()/localNs.median(), "cluster/local")
			}
		})
	}
}

// pageLoop reads the first page of limit CEs at base b.N times, forwarded (from the ledger
// there) or not (the cluster's), and fails unless the first answer lists want with next after
// its last id and every later answer equals the first.
func pageLoop(b *testing.B, client *http.Client, base string, limit int, forwarded bool, want []string) {
	url := base + "/v1/counterfactuals?limit=" + strconv.Itoa(limit)
	var first []byte
	for b.Loop() {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		if err != nil {
			b.Fatal(err)
		}
		if forwarded {
			req.Header.Set(headerForwarded, "bench")
		}
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			b.Fatal(err)
		}
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("GET %s (forwarded %v): %d %s", url, forwarded, resp.StatusCode, body)
		}
		if first != nil {
			if !bytes.Equal(body, first) {
				b.Fatalf("GET %s (forwarded %v) answered another page than its first: %.300s", url, forwarded, body)
			}
			continue
		}
		var page struct {
			CEs []struct {
				ID string `json:"id"`
			} `json:"counterfactuals"`
			Next string `json:"next"`
		}
		if err := json.Unmarshal(body, &page); err != nil {
			b.Fatalf("GET %s: %v", url, err)
		}
		var ids []string
		for _, ce := range page.CEs {
			ids = append(ids, ce.ID)
		}
		if !slices.Equal(ids, want) || page.Next != want[len(want)-1] {
			b.Fatalf("GET %s (forwarded %v) listed %v next %q; want %v next %q", url, forwarded, ids, page.Next, want, want[len(want)-1])
		}
		first = body
	}
}

// benchRuns collects the ns/op of a sub-benchmark's runs (each call of its function) with
// their b.N.
type benchRuns []struct {
	n  int
	ns float64
}

func (r *benchRuns) add(b *testing.B) {
	*r = append(*r, struct {
		n  int
		ns float64
	}{b.N, float64(b.Elapsed().Nanoseconds()) / float64(b.N)})
}

func (r benchRuns) last() float64 { return r[len(r)-1].ns }

// median is the median ns/op of the runs with the largest b.N (the runs reported; smaller ones
// only size b.N). r holds at least one run.
func (r benchRuns) median() float64 {
	n := 0
	for _, x := range r {
		n = max(n, x.n)
	}
	var ns []float64
	for _, x := range r {
		if x.n == n {
			ns = append(ns, x.ns)
		}
	}
	slices.Sort(ns)
	if len(ns)%2 == 1 {
		return ns[len(ns)/2]
	}
	return (ns[len(ns)/2-1] + ns[len(ns)/2]) / 2
}

// registerSpread registers n CEs with ids ce-00000... round-robin at the replicas, from 16
// concurrent clients (the candidate pairs of registerCEs, reused in turn), and returns their
// ids in id order. Each is stored by its owner when its registration is answered.
func registerSpread(b *testing.B, reps []*running, n int) []string {
	b.Helper()
	data := bundled(b)
	_, xs, cfs := candidatePairs(b, reps[0].d.current(), data, 400, 1)
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
				if err := postCE(client, reps[k%len(reps)].base, body); err != nil {
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
