package serving

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
)

func TestJSONBodiesAreStrict(t *testing.T) {
	r := launch.Daemon(t, nil)
	x, _ := json.Marshal(daemontest.Bundled(t).X[0])
	for name, body := range map[string]string{
		"trailing object": `{"x":` + string(x) + `}{"x":` + string(x) + `}`,
		"trailing junk":   `{"x":` + string(x) + `} trailing`,
		"unknown field":   `{"x":` + string(x) + `,"z":1}`,
		"both x and xs":   `{"x":` + string(x) + `,"xs":[` + string(x) + `]}`,
		"neither":         `{}`,
	} {
		resp, b := r.RawDo(t, "POST", "/v1/predict", body, nil)
		if resp.StatusCode != http.StatusBadRequest || !bytes.Contains(b, []byte(`"error"`)) {
			t.Errorf("%s: %d %s, want 400 with an error", name, resp.StatusCode, b)
		}
	}
	// Whitespace after the value is not trailing data.
	if resp, b := r.RawDo(t, "POST", "/v1/predict", `{"x":`+string(x)+"}\n\n", nil); resp.StatusCode != 200 {
		t.Errorf("a body ending in newlines: %d %s", resp.StatusCode, b)
	}
}
