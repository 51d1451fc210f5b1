package cluster

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/ceshare"
)

// A registration's CE is read only when it is a Measured and nothing else: a field this build
// does not know blocks the partition (ceshare.MemberConfig.Readable) instead of being dropped.
func TestReadableTakesOnlyAMeasured(t *testing.T) {
	same, err := json.Marshal(Measured{X: []float64{1, 2}, XCF: []float64{1, 3}, Target: 1, AnchorVersion: 4, P1: 0.9, Var1: 0.01, Samples: 1000, Delta: 0.5, Epsilon: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, kind, ce string
		want           string // "" for readable, else a part of the error
	}{
		{"this build's CE", ceshare.KindRegister, string(same), ""},
		{"an older build's CE, fewer fields", ceshare.KindRegister, `{"x":[1],"x_cf":[2],"target":0}`, ""},
		{"a field this build does not know", ceshare.KindRegister, strings.Replace(string(same), `{`, `{"condition":"x",`, 1), `unknown field "condition"`},
		{"a field of another type", ceshare.KindRegister, `{"x":"1"}`, "cannot unmarshal"},
		{"data after the object", ceshare.KindRegister, string(same) + ` {}`, "data after the JSON object"},
		{"a deletion", ceshare.KindDelete, ``, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := readable(ceshare.Request{Kind: c.kind, ID: "ce-1", CE: json.RawMessage(c.ce)})
			switch {
			case c.want == "" && err != nil:
				t.Errorf("readable: %v, want nil", err)
			case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
				t.Errorf("readable: %v, want an error with %q", err, c.want)
			}
		})
	}
}

// A replica names a blocked partition before one that is only being rebuilt: the rebuild ends
// on its own, the block does not.
func TestFirstNotCaughtUpNamesABlockFirst(t *testing.T) {
	for _, c := range []struct {
		name        string
		notCaughtUp []int
		blocked     []ceshare.Blocked
		want        int
		ok          bool
	}{
		{"none", nil, nil, 0, false},
		{"a rebuild", []int{2, 5}, nil, 2, true},
		{"a rebuild before a block", []int{2, 5}, []ceshare.Blocked{{Partition: 5}}, 5, true},
	} {
		if got, ok := firstNotCaughtUp(c.notCaughtUp, c.blocked); got != c.want || ok != c.ok {
			t.Errorf("%s: firstNotCaughtUp = %d, %v; want %d, %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

// A list that fails at several replicas answers with a blocked one's failure when there is one,
// else with the first replica's by id.
func TestFirstFailureNamesABlockFirst(t *testing.T) {
	rebuild := fmt.Errorf("%w: r1", ErrRebuilding)
	peer := fmt.Errorf("%w: r2", ErrPeer)
	blocked := fmt.Errorf("%w: r3", ErrBlocked)
	for _, c := range []struct {
		name   string
		failed map[string]error
		want   error
	}{
		{"none", nil, nil},
		{"by id", map[string]error{"r1": rebuild, "r2": peer}, rebuild},
		{"a block after others", map[string]error{"r1": rebuild, "r2": peer, "r3": blocked}, blocked},
	} {
		if got := firstFailure(c.failed); got != c.want {
			t.Errorf("%s: firstFailure = %v, want %v", c.name, got, c.want)
		}
	}
}

// A peer's 503 is quoted by its error, not its JSON: the client of a forwarding replica reads the
// owner's words once, without escaped quotes.
func TestPeerErrorQuotesTheError(t *testing.T) {
	for _, c := range []struct{ body, want string }{
		{`{"error":"partition 1 blocked by \"r9\""}` + "\n", `partition 1 blocked by "r9"`},
		{"  not json \n", "not json"},
		{`{"other":1}`, `{"other":1}`},
	} {
		if got := peerError([]byte(c.body)); got != c.want {
			t.Errorf("peerError(%q) = %q, want %q", c.body, got, c.want)
		}
	}
}
