package tooltest

import (
	"bytes"
	"encoding/json"
	"strings"
	"sync"
)

// Output collects what a program a test started writes to its stdout and stderr (both may write
// at once, from exec's copying goroutines) while the test reads it.
type Output struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}

// Logged returns the value of key in the first complete log line whose message is msg ("" if
// there is none yet): a logfmt line (msg="msg" key=value; the brackets slog puts around a list are
// dropped) or a JSON one ({"msg":"msg","key":"value"}; a list gives its first element). It is
// how a test learns the port a program bound when told to listen on 127.0.0.1:0: cfguard logs
// msg="HTTP API listening" addr=..., Prometheus and Alertmanager msg="Listening on" address=...,
// so that no test has to reserve a port and hope nobody takes it before the program binds it.
func (o *Output) Logged(msg, key string) string {
	text := o.String()
	text = text[:strings.LastIndexByte(text, '\n')+1] // a line still being written may be cut short
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "{") {
			if v, ok := loggedJSON(line, msg, key); ok {
				return v
			}
			continue
		}
		if !strings.Contains(line, `msg="`+msg+`"`) {
			continue
		}
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, key+"="); ok {
				return strings.Trim(v, "[]")
			}
		}
	}
	return ""
}

// loggedJSON is Logged for one JSON log line.
func loggedJSON(line, msg, key string) (string, bool) {
	var rec map[string]any
	if json.Unmarshal([]byte(line), &rec) != nil || rec["msg"] != msg {
		return "", false
	}
	switch v := rec[key].(type) {
	case string:
		return v, true
	case []any:
		if len(v) > 0 {
			if s, ok := v[0].(string); ok {
				return s, true
			}
		}
	}
	return "", false
}
