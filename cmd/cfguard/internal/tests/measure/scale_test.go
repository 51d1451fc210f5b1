package measure

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestMeasureScale measures one daemon as its store grows: for 10^4 and 10^5 stored CEs (and 10^6
// with CFGUARD_BENCH_1M=1) it puts the CEs into a fresh ledger through the ledger's API (real CEs
// of the bundled model, certified at 1000 draws), then starts the `cfguard run` binary on it,
// built as `go build` and as `go build -tags openblas` (skipped without gcc), with the embedded
// broker on loopback, pinned with taskset to one core (audit.workers 1) and to two
// (audit.workers 2), and reports for every start
//
//   - start: from exec to the first /readyz 200;
//   - RSS at ready, steady (VmRSS, and its anonymous part, once the process has used no CPU for
//     a second) and peak (VmHWM) before and after a full audit, from /proc/<pid>/status;
//   - a full audit (POST /v1/audit, which answers when it is done): its wall time and the CEs it
//     evaluated, which must be every stored one.
//
// and, per size, the ledger file's bytes per CE. The audit runs at certify.samples 1000 (the
// default) at every size and also at the fewest the configuration allows from 10^5 on
// (scaleSamples). It runs real processes for tens of minutes (an hour with 10^6), so
// `go test ./...` skips it:
//
//	CFGUARD_MEASURE_SCALE=1 go test ./cmd/cfguard/... -run TestMeasureScale -v -timeout 3h
func TestMeasureScale(t *testing.T) {
	taskset := requireTwoCoreMeasure(t, "CFGUARD_MEASURE_SCALE", "daemon processes over large ledgers")
	sizes := []int{10_000, 100_000}
	if os.Getenv("CFGUARD_BENCH_1M") == "1" {
		sizes = append(sizes, 1_000_000)
	}
	root := t.TempDir()
	set, _, modelDir := proc.TrainModel(t, root)
	builds := scaleBinaries(t, root)

	var rows []scaleRow
	for _, n := range sizes {
		dir := filepath.Join(root, fmt.Sprintf("n%d", n))
		cfg := scaleConfig(t, dir, modelDir, 1000, 1)
		// A first start makes the state directory (posterior, broker data) the CEs go into.
		first := startScaleProc(t, taskset, builds[0].path, cfg, "0,1")
		first.waitReady(t)
		first.Stop(t)
		db := filepath.Join(dir, "state", ledger.FileName)
		before := fileSize(t, db)
		at := time.Now()
		fillLedger(t, filepath.Join(dir, "state"), set, n)
		fill := time.Since(at)
		perCE := float64(fileSize(t, db)-before) / float64(n)
		t.Logf("%d CEs put in %v; %s %.1f MB, %.0f bytes per CE", n, fill.Round(time.Millisecond), ledger.FileName, float64(fileSize(t, db))/1e6, perCE)

		// 1 and 2 cores, and the builds, alternate start by start (rounds of each).
		for _, s := range scaleSamples(n) {
			for range s.rounds {
				for _, b := range builds {
					if s.only != "" && b.name != s.only {
						continue
					}
					for _, cores := range []int{1, 2} {
						scaleConfig(t, dir, modelDir, s.samples, cores)
						r := scaleRow{n: n, build: b.name, cores: cores, samples: s.samples, bytesPerCE: perCE}
						r.measure(t, taskset, b.path, cfg, s.audit)
						t.Logf("%+v", r)
						rows = append(rows, r)
					}
				}
			}
		}
	}
	t.Log("\n" + scaleTable(rows))
}

// requireTwoCoreMeasure skips a measurement of daemon processes (what) unless env is 1, and
// where it cannot pin them to cores 0 and 1 or read /proc; it returns the taskset command.
func requireTwoCoreMeasure(t *testing.T, env, what string) (taskset string) {
	t.Helper()
	if os.Getenv(env) != "1" {
		t.Skipf("a measurement of %s: set %s=1 to run it", what, env)
	}
	if runtime.GOOS != "linux" || runtime.NumCPU() < 2 {
		t.Skip("reads /proc and pins to cores 0 and 1: needs linux and two cores")
	}
	return tooltest.Command(t, "apt-get install util-linux", "taskset")
}

// scaleBuild is a cfguard binary and the build it is.
type scaleBuild struct{ name, path string }

// scaleBinaries builds cfguard as `go build` and, when gcc is there, as `go build -tags
// openblas` (the default image's build), the OpenBLAS one first.
func scaleBinaries(t *testing.T, dir string) []scaleBuild {
	t.Helper()
	var out []scaleBuild
	for _, b := range []struct{ name, tags string }{{"openblas", "openblas"}, {"go", ""}} {
		if b.tags == "openblas" {
			if _, err := exec.LookPath("gcc"); err != nil {
				t.Logf("no gcc: the -tags openblas build is not measured")
				continue
			}
		}
		p := filepath.Join(dir, "cfguard-"+b.name)
		cmd := exec.Command("go", "build", "-tags", b.tags, "-o", p, "github.com/cfguard/cfguard/cmd/cfguard")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build -tags %q: %v\n%s", b.tags, err, out)
		}
		out = append(out, scaleBuild{b.name, p})
	}
	return out
}

// scaleSample is one certify.samples setting, whether its starts run an audit, and how many
// rounds of starts it gets.
type scaleSample struct {
	samples int
	audit   bool
	rounds  int
	only    string // a build name: the other builds skip this setting
}

// scaleSamples: the audit at 1000 draws (the default), twice up to 10^5, and at the fewest draws
// the configuration allows at the default certify.delta and certify.verdict_alpha (249) from
// 10^5 on, so that the cost per CE and draw is measured at two draw counts and at two sizes.
// At 10^6 only the OpenBLAS build audits at 1000 draws (its CPU time is ~3 min; the default
// build's is ~11 min, which its audit at fewer draws and the ratios at 10^5 extrapolate).
func scaleSamples(n int) []scaleSample {
	def := config.Default().Certify
	fewest := certify.MinRenewableSamples(def.Delta, def.VerdictAlpha)
	switch {
	case n < 100_000:
		return []scaleSample{{1000, true, 2, ""}}
	case n == 100_000:
		return []scaleSample{{1000, true, 2, ""}, {fewest, true, 2, ""}}
	default:
		return []scaleSample{{fewest, true, 1, ""}, {1000, true, 1, "openblas"}}
	}
}

// scaleConfig writes dir/config.yaml: the embedded broker on loopback, scheduled audits off (the
// test starts them), and certify.samples and audit.workers as given. POST /v1/audit answers when
// the audit ends, however long after http.write_timeout.
func scaleConfig(t *testing.T, dir, modelDir string, samples, workers int) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`http:
  listen: %s
state_dir: %s
model:
  path: %s
kafka:
  brokers: []
  embedded_listen: 127.0.0.1:0
certify:
  samples: %d
audit:
  schedule: ""
  workers: %d
log:
  level: info
`, proc.AnyPort, filepath.Join(dir, "state"), modelDir, samples, workers)
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// fillLedger puts n CEs into the stopped daemon's ledger in batches of 50,000, as a fresh
// ledger gets them: pairs of the data set's rows that the ledger's posterior puts in class 0
// (x) and in class 1 with p > 0.96 and variance < 0.009 (x'), each certified with 1000 draws as
// registration does. There are fewer distinct pairs than CEs at 10^5 and more: the ids differ,
// the inputs repeat, which costs an audit the same.
func fillLedger(t *testing.T, stateDir string, set *dataset.Set, n int) {
	t.Helper()
	l, err := ledger.Open(stateDir, ledger.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	m, err := l.Current()
	if err != nil {
		t.Fatal(err)
	}
	p, err := m.Predict(set.X, 1000, 1)
	if err != nil {
		t.Fatal(err)
	}
	var xs, cfs []int
	for i := range set.X {
		switch {
		case p.Argmax(i) == 0 && p.P(i, 0) > 0.9:
			xs = append(xs, i)
		case p.P(i, 1) > 0.96 && p.V(i, 1) < 0.009:
			cfs = append(cfs, i)
		}
	}
	if len(xs) == 0 || len(cfs) == 0 {
		t.Fatalf("no pairs for CEs: %d candidates for x, %d for x'", len(xs), len(cfs))
	}
	const batch = 50_000
	for lo := 0; lo < n; lo += batch {
		ces := make([]*ledger.CE, 0, min(batch, n-lo))
		for i := lo; i < min(lo+batch, n); i++ {
			x, cf := xs[i%len(xs)], cfs[(i/len(xs))%len(cfs)]
			ces = append(ces, &ledger.CE{ID: fmt.Sprintf("ce-%07d", i), X: set.X[x], XCF: set.X[cf], Target: 1,
				AnchorVersion: m.Version, P1: p.P(cf, 1), Var1: p.V(cf, 1), Samples: 1000, Delta: 0.05, Epsilon: 0.01})
		}
		if err := l.Put(t.Context(), ces...); err != nil {
			t.Fatal(err)
		}
	}
	counts, err := l.Counts()
	if err != nil {
		t.Fatal(err)
	}
	if counts[certify.Certified] != n {
		t.Fatalf("the ledger holds %v CEs, want %d certified", counts, n)
	}
}

func fileSize(t *testing.T, p string) int64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

// scaleProc is a `cfguard run` process pinned with taskset (which execs it: the pid is cfguard's).
type scaleProc struct {
	Cmd     *exec.Cmd
	Log     *tooltest.Output
	started time.Time
	Done    chan struct{} // closed once the process exited and was waited for (Err set)
	Err     error         // Cmd.Wait's
}

func startScaleProc(t *testing.T, taskset, bin, cfg, cpus string) *scaleProc {
	t.Helper()
	cmd := exec.Command(taskset, "-c", cpus, bin, "run", "--config", cfg)
	cmd.Env = append(os.Environ(), "CFGUARD_HTTP_TOKEN=", "CFGUARD_HTTP_METRICS_TOKEN=")
	p := &scaleProc{Cmd: cmd, Log: &tooltest.Output{}, Done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.Log, p.Log
	p.started = time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.Err = cmd.Wait()
		close(p.Done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.Done:
		default:
			cmd.Process.Kill()
			<-p.Done
		}
	})
	return p
}

func (p *scaleProc) Addr() string { return p.Log.Logged("HTTP API listening", "addr") }

// waitReady waits for the first /readyz 200 and returns the time since exec.
func (p *scaleProc) waitReady(t *testing.T) time.Duration {
	t.Helper()
	cl := http.Client{Timeout: time.Second}
	var took time.Duration
	waitfor.Cond(t, 10*time.Minute, "/readyz 200", func() bool {
		select {
		case <-p.Done:
			t.Fatalf("cfguard exited before it was ready: %v\n%s", p.Err, p.Log.String())
		default:
		}
		a := p.Addr()
		if a == "" {
			return false
		}
		resp, err := cl.Get("http://" + a + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		took = time.Since(p.started)
		return resp.StatusCode == http.StatusOK
	})
	return took
}

func (p *scaleProc) Stop(t *testing.T) {
	t.Helper()
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done:
		if p.Err != nil {
			t.Fatalf("cfguard after SIGTERM: %v\n%s", p.Err, p.Log.String())
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("cfguard did not stop within 2 min of SIGTERM")
	}
}

// status reads the kB fields of /proc/<pid>/status, in MB.
func (p *scaleProc) status(t *testing.T) map[string]float64 {
	t.Helper()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.Cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(raw), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if f := strings.Fields(v); ok && len(f) == 2 && f[1] == "kB" {
			x, _ := strconv.ParseFloat(f[0], 64)
			out[k] = x / 1024
		}
	}
	return out
}

// CPU is the process's user and system CPU seconds (tooltest.CPU).
func (p *scaleProc) CPU(t *testing.T) float64 {
	t.Helper()
	d, err := tooltest.CPU(p.Cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	return d.Seconds()
}

// waitIdle waits until the process has used at most 20 ms of CPU over a second.
func (p *scaleProc) waitIdle(t *testing.T) {
	t.Helper()
	last, at := p.CPU(t), time.Now()
	waitfor.Cond(t, 5*time.Minute, "the daemon idle (<= 20 ms of CPU in a second)", func() bool {
		if time.Since(at) < time.Second {
			return false
		}
		c := p.CPU(t)
		idle := c-last <= 0.02
		last, at = c, time.Now()
		return idle
	})
}

// Audit runs POST /v1/audit and returns its wall time and report.
func (p *scaleProc) Audit(t *testing.T) (time.Duration, ledger.AuditReport) {
	t.Helper()
	cl := http.Client{Timeout: 2 * time.Hour}
	at := time.Now()
	resp, err := cl.Post("http://"+p.Addr()+"/v1/audit", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	took := time.Since(at)
	var rep ledger.AuditReport
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /v1/audit: %s", resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(&rep); err != nil {
		t.Fatal(err)
	}
	return took, rep
}

// scaleRow is one start of the daemon.
type scaleRow struct {
	n, cores, samples                       int
	build                                   string
	bytesPerCE                              float64
	start                                   time.Duration
	readyRSS, steadyRSS, steadyAnon, hwm    float64 // MB
	auditTook                               time.Duration
	auditCPU, hwmAfterAudit, rssAfterAudit  float64
	evaluated, certifiedAfter, behindOrLost int
	load                                    string // /proc/loadavg's 1-minute figure when the audit (or the start) ended
}

// measure starts the daemon pinned to r.cores cores and takes the row's figures.
func (r *scaleRow) measure(t *testing.T, taskset, bin, cfg string, audit bool) {
	t.Helper()
	p := startScaleProc(t, taskset, bin, cfg, map[int]string{1: "0", 2: "0,1"}[r.cores])
	r.start = p.waitReady(t)
	r.readyRSS = p.status(t)["VmRSS"]
	p.waitIdle(t)
	st := p.status(t)
	r.steadyRSS, r.steadyAnon, r.hwm = st["VmRSS"], st["RssAnon"], st["VmHWM"]
	if audit {
		c0 := p.CPU(t)
		var rep ledger.AuditReport
		r.auditTook, rep = p.Audit(t)
		r.auditCPU = p.CPU(t) - c0
		if rep.Evaluated != r.n {
			t.Fatalf("the audit evaluated %d CEs of %d: %+v", rep.Evaluated, r.n, rep)
		}
		r.evaluated, r.certifiedAfter, r.behindOrLost = rep.Evaluated, rep.Counts[certify.Certified], rep.Behind
		st = p.status(t)
		r.hwmAfterAudit, r.rssAfterAudit = st["VmHWM"], st["VmRSS"]
	}
	r.load = strings.Fields(loadAverage())[0]
	p.Stop(t)
}

// scaleTable prints the rows as Markdown, headed by the load average.
func scaleTable(rows []scaleRow) string {
	var b strings.Builder
	fmt.Fprintf(&b, "load average %s, GOMAXPROCS of the test %d\n\n", loadAverage(), runtime.GOMAXPROCS(0))
	b.WriteString("| CEs | build | cores | samples | bytes/CE | start -> ready | RSS ready / steady (anon) / peak MB | audit | audit CPU s (/wall) | certified after | RSS / peak after audit MB | load |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		audit, ratio := "-", "-"
		if r.auditTook > 0 {
			audit = r.auditTook.Round(10 * time.Millisecond).String()
			ratio = fmt.Sprintf("%.2f (%.2f)", r.auditCPU, r.auditCPU/r.auditTook.Seconds())
		}
		fmt.Fprintf(&b, "| %d | %s | %d | %d | %.0f | %v | %.0f / %.0f (%.0f) / %.0f | %s | %s | %d | %.0f / %.0f | %s |\n",
			r.n, r.build, r.cores, r.samples, r.bytesPerCE, r.start.Round(time.Millisecond),
			r.readyRSS, r.steadyRSS, r.steadyAnon, r.hwm, audit, ratio, r.certifiedAfter, r.rssAfterAudit, r.hwmAfterAudit, r.load)
	}
	return b.String()
}
