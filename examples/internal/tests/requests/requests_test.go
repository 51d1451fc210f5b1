package requests

import (
	"encoding/json"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/examples/internal/modelserver"
	"github.com/cfguard/cfguard/internal/tooltest"
)

// TestModelServerRequests: a single input gets scalar fields; malformed requests get 400 with a
// message naming what is wrong; a directory without a model stops the server at start.
func TestModelServerRequests(t *testing.T) {
	py := tooltest.PythonTorch(t)
	m := bnn.New(3, []int{4}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(1, 2)))
	dir := t.TempDir()
	if err := bnn.Save(dir, m); err != nil {
		t.Fatal(err)
	}
	url, _ := modelserver.Start(t, py, dir, 100)
	resp, err := http.Post(url+"/predict", "application/json", strings.NewReader(`{"x": [1, 2, 3]}`))
	if err != nil {
		t.Fatal(err)
	}
	var one struct {
		P     []float64 `json:"p"`
		Class string    `json:"class"`
	}
	json.NewDecoder(resp.Body).Decode(&one)
	resp.Body.Close()
	if len(one.P) != 2 || math.Abs(one.P[0]+one.P[1]-1) > 1e-12 || (one.Class != "no" && one.Class != "yes") {
		t.Errorf("single input: %+v", one)
	}
	for _, tc := range []struct{ body, want string }{
		{`{"x": [1, 2]}`, "input 0: want 3 finite numbers"},
		{`{"xs": [[1, 2, 3], [1, "a", 3]]}`, "input 1: want 3 finite numbers"},
		{`{"xs": []}`, `want {\"x\": [features]}`},
		{`{"x": [1, 2, 3], "xs": [[1, 2, 3]]}`, `want {\"x\"`},
		{`{"x": [1, 2, 1e999]}`, "input 0"},
		{`not json`, "Expecting value"},
	} {
		resp, err := http.Post(url+"/predict", "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(raw), tc.want) {
			t.Errorf("%s: %s %s, want 400 with %q", tc.body, resp.Status, raw, tc.want)
		}
	}
	if resp, err := http.Get(url + "/nope"); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /nope: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}

	// A directory without a sidecar, or with one that is not JSON, stops the server at start
	// with the sidecar's path.
	empty, damaged := t.TempDir(), t.TempDir()
	if err := os.WriteFile(filepath.Join(damaged, bnn.SidecarFile), []byte(`{"format": `), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{empty, damaged} {
		out, err := exec.Command(py, modelserver.Script(t), "--model-dir", dir, "--port", "0").CombinedOutput()
		if want := filepath.Join(dir, bnn.SidecarFile) + ": "; err == nil || !strings.Contains(string(out), want) {
			t.Errorf("server on %s: %v, %s; want an error naming %q", dir, err, out, want)
		}
	}
}
