package serving

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// TestJSONBodiesRefuseWhatEncodingJSONLetsThrough: duplicate keys (at any depth), keys that match
// a field only by case folding, and null for a field are 400s naming the key, on every route
// that takes a body, before any work is done.
func TestJSONBodiesRefuseWhatEncodingJSONLetsThrough(t *testing.T) {
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	x, _ := json.Marshal(data.X[0])
	xcf, _ := json.Marshal(data.X[1])
	X, XCF := string(x), string(xcf)
	for _, c := range []struct {
		name, path, body string
		want             string // in the error
	}{
		{"duplicate key", "/v1/predict", `{"x":` + X + `,"x":` + X + `}`, `duplicate key \"x\"`},
		{"duplicate key in a nested object", "/v1/predict", `{"xs":[{"a":1,"b":{"c":1},"a":2}]}`, `in \"xs\": duplicate key \"a\"`},
		{"duplicate key deeper", "/v1/predict", `{"xs":[[{"c":[1,{"d":1,"d":1}]}]]}`, `duplicate key \"d\"`},
		{"case-folded key", "/v1/predict", `{"X":` + X + `}`, `unknown field \"X\" (keys are case-sensitive: did you mean \"x\"?)`},
		{"case-folded key, register", "/v1/counterfactuals", `{"x":` + X + `,"X_CF":` + XCF + `,"target":1}`, `did you mean \"x_cf\"?`},
		{"null field", "/v1/predict", `{"x":null,"xs":[` + X + `]}`, `\"x\" is null`},
		{"null target, register", "/v1/counterfactuals", `{"x":` + X + `,"x_cf":` + XCF + `,"target":null}`, `\"target\" is null`},
		{"null target, explain", "/v1/explain", `{"x":` + X + `,"target":null}`, `\"target\" is null`},
		{"duplicate target, register", "/v1/counterfactuals", `{"x":` + X + `,"x_cf":` + XCF + `,"target":0,"target":1}`, `duplicate key \"target\"`},
		{"fractional target", "/v1/counterfactuals", `{"x":` + X + `,"x_cf":` + XCF + `,"target":1.5}`, `target must be a class index (an integer) or a class name, got 1.5`},
		{"unknown field", "/v1/explain", `{"x":` + X + `,"z":1}`, `unknown field \"z\"`},
		{"a field for the audit, which takes none", "/v1/audit", `{"bogus":1}`, `unknown field \"bogus\" (this body takes no fields: send {} or no body)`},
		{"an audit body that is not an object", "/v1/audit", `[1]`, `bad JSON`},
		{"empty id, register", "/v1/counterfactuals", `{"id":"","x":` + X + `,"x_cf":` + XCF + `,"target":1}`, `id is empty`},
		{"empty id, explain", "/v1/explain", `{"id":"","x":` + X + `}`, `id is empty`},
		{"id not a string, register", "/v1/counterfactuals", `{"id":7,"x":` + X + `,"x_cf":` + XCF + `,"target":1}`, `id must be a string, got 7`},
	} {
		resp, b := r.RawDo(t, "POST", c.path, c.body, nil)
		if resp.StatusCode != http.StatusBadRequest || !bytes.Contains(b, []byte(c.want)) {
			t.Errorf("%s: %d %s, want 400 with %s", c.name, resp.StatusCode, b, c.want)
		}
	}
	// A bulk line with an empty id refuses only itself, naming the field.
	if resp, b := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", `{"id":"","x":`+X+`,"x_cf":`+XCF+`,"target":1}`+"\n", nil); resp.StatusCode != 200 ||
		!bytes.Contains(b, []byte(`"code":400`)) || !bytes.Contains(b, []byte(`id is empty`)) || !bytes.Contains(b, []byte(`"refused":1`)) {
		t.Errorf("bulk line with an empty id: %d %s, want 200 with the line refused (400, id is empty)", resp.StatusCode, b)
	}
	// The same keys, once each and in their case, are fine; an audit takes {} or no body.
	if resp, b := r.RawDo(t, "POST", "/v1/predict", `{"xs":[`+X+`,`+XCF+`]}`, nil); resp.StatusCode != 200 {
		t.Errorf("a good predict: %d %s", resp.StatusCode, b)
	}
	for _, body := range []string{"{}", " {} \n", ""} {
		if resp, b := r.RawDo(t, "POST", "/v1/audit", body, nil); resp.StatusCode != 200 {
			t.Errorf("an audit with body %q: %d %s", body, resp.StatusCode, b)
		}
	}
	if n := r.Metric(t, "cfguard_counterfactuals", "status", "certified") + r.Metric(t, "cfguard_counterfactuals", "status", "uncertified"); n != 0 {
		t.Errorf("%v CEs stored from refused bodies", n)
	}
}

// TestSlowBodiesAreCutAndHealthzAnswers: 200 connections send their headers, then their body one
// byte at a time. The daemon holds at most http.max_connections (128) of them, cuts each with a
// 408 once http.read_timeout (1 s) has passed since it was accepted, and /healthz on a new
// connection, queued behind the rest of the flood, answers while some are still hanging.
func TestSlowBodiesAreCutAndHealthzAnswers(t *testing.T) {
	const flood, limit, readTimeout = 200, 128, time.Second
	r := launch.Daemon(t, func(c *config.Config) { c.HTTP.ReadTimeout, c.HTTP.MaxConnections = readTimeout, limit })

	// Watch the connections the daemon holds for the whole test.
	stop := make(chan struct{})
	var most float64
	var watch sync.WaitGroup
	watch.Go(func() {
		for {
			most = max(most, daemontest.GatherCounter(r.Reg, "cfguard_http_connections"))
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
	})
	t.Cleanup(func() { // after the connections' cleanup below
		select {
		case <-stop:
		default:
			close(stop)
		}
		watch.Wait()
	})

	conns := make([]net.Conn, flood)
	statuses := make(chan string, flood)
	var clients sync.WaitGroup
	t.Cleanup(func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
		clients.Wait()
	})
	for i := range conns {
		c, err := net.Dial("tcp", r.D.HTTPAddr())
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
		if _, err := io.WriteString(c, "POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"xs\":["); err != nil {
			t.Fatal(err)
		}
		clients.Go(func() { // the status line of the answer, or why there is none
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil {
				line = "no answer: " + err.Error()
			}
			statuses <- strings.TrimSpace(line)
		})
	}
	// One byte per connection every 100 ms, until the test ends.
	watch.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			for _, c := range conns {
				c.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
				c.Write([]byte(" ")) // fails once the daemon has cut it
			}
		}
	})
	waitfor.Cond(t, 10*time.Second, "the daemon to hold http.max_connections connections", func() bool {
		return daemontest.GatherCounter(r.Reg, "cfguard_http_connections") >= limit
	})
	probe := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	start := time.Now()
	resp, err := probe.Get(r.Base + "/healthz")
	took := time.Since(start) // logged, not bounded: the order below is what is checked
	if err != nil {
		t.Fatalf("/healthz during the flood: %v", err)
	}
	resp.Body.Close()
	answered := len(statuses)
	// Queued behind 72 slow connections, the probe is accepted when the first 128 are cut: it is
	// answered while some of the flood still hangs (not when every slow connection was cut).
	if resp.StatusCode != 200 {
		t.Fatalf("/healthz during the flood: %d, want 200", resp.StatusCode)
	}
	if answered >= flood {
		t.Fatalf("/healthz answered after all %d slow connections were cut, not while some hang", flood)
	}
	t.Logf("/healthz answered in %v with %d of %d slow connections cut", took.Round(time.Millisecond), answered, flood)

	for i := range flood {
		select {
		case s := <-statuses:
			if !strings.HasPrefix(s, "HTTP/1.1 408 ") {
				t.Fatalf("slow connection %d: %q, want 408", i, s)
			}
		case <-time.After(4*readTimeout + 5*time.Second):
			t.Fatalf("%d of %d slow connections still hang", flood-i, flood)
		}
	}
	close(stop)
	watch.Wait()
	if most > limit {
		t.Fatalf("the daemon held %v connections, over http.max_connections %d", most, limit)
	}
	if code, b := r.Get(t, "/healthz"); code != 200 {
		t.Fatalf("/healthz after the flood: %d %s", code, b)
	}
}
