package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

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

// A peer's answer is decoded on 200; a 409 is ErrPeerBusy, a 503 ErrRebuilding (ErrBlocked, itself
// an ErrRebuilding, when the peer marked it HeaderBlocked), anything else, or a 200 that does not
// decode, an ErrPeer.
func TestDecodePeer(t *testing.T) {
	o := ceshare.Owner{Replica: "r2"}
	for _, c := range []struct {
		name string
		a    peerAnswer
		is   []error // what the error matches; nil for no error
		not  []error // what it must not match
	}{
		{"a page", peerAnswer{code: http.StatusOK, body: []byte(`{"n":1}`)}, nil, nil},
		{"a 200 that does not decode", peerAnswer{code: http.StatusOK, body: []byte(`{`)}, []error{ErrPeer}, nil},
		{"an audit running there", peerAnswer{code: http.StatusConflict, body: []byte("busy")}, []error{ErrPeerBusy}, []error{ErrPeer}},
		{"rebuilding", peerAnswer{code: http.StatusServiceUnavailable}, []error{ErrRebuilding}, []error{ErrBlocked, ErrPeer}},
		{"blocked", peerAnswer{code: http.StatusServiceUnavailable, blocked: true}, []error{ErrBlocked, ErrRebuilding}, []error{ErrPeer}},
		{"another answer", peerAnswer{code: http.StatusTooManyRequests}, []error{ErrPeer}, []error{ErrPeerBusy, ErrRebuilding}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var v struct{ N int }
			err := decodePeer(o, c.a, &v)
			if c.is == nil && (err != nil || v.N != 1) {
				t.Fatalf("decodePeer = %v, %+v; want the answer", err, v)
			}
			for _, e := range c.is {
				if !errors.Is(err, e) {
					t.Errorf("decodePeer = %v, want an error matching %v", err, e)
				}
			}
			for _, e := range c.not {
				if errors.Is(err, e) {
					t.Errorf("decodePeer = %v, matches %v", err, e)
				}
			}
		})
	}
}

// A partition blocked at a request (blockedError) is ErrBlocked, and so ErrRebuilding: a list or
// an audit that meets it answers 503 as for a rebuild, naming the block.
func TestBlockedIsRebuilding(t *testing.T) {
	err := fmt.Errorf("listing: %w", blockedError("partition 3 blocked"))
	if !errors.Is(err, ErrBlocked) || !errors.Is(err, ErrRebuilding) || errors.Is(fmt.Errorf("%w", ErrRebuilding), ErrBlocked) {
		t.Errorf("a blocked partition's error %v: ErrBlocked %v, ErrRebuilding %v", err, errors.Is(err, ErrBlocked), errors.Is(err, ErrRebuilding))
	}
}

// A replica between two generations of the CE group (generation 0: it does not know its
// partitions) does not hold its share whole; a Share not joined yet is healthy.
func TestHoldsWholeBetweenGenerations(t *testing.T) {
	s := &Share{member: &ceshare.Member{}}
	if err := s.HoldsWhole([]int{0}); !errors.Is(err, ErrRebuilding) {
		t.Errorf("HoldsWhole at generation 0 = %v, want ErrRebuilding", err)
	}
	if err := (*Share)(nil).Health(); err != nil {
		t.Errorf("Health of a Share not joined = %v, want nil", err)
	}
}

// An audit does not cover a share that has not settled (a pause of the process past its session,
// or a start): CaughtUp says so before anything else it finds, since the partitions the member
// holds may be another replica's; once settled, it says what HoldsWhole says.
func TestCaughtUpNamesAnUnsettledShareFirst(t *testing.T) {
	s := &Share{topic: "cfguard.ce", member: &ceshare.Member{}}
	settled := make(chan struct{})
	close(settled)
	for _, tc := range []struct {
		name    string
		settled chan struct{}
		want    string
	}{
		{name: "not settled", settled: make(chan struct{}), want: "paused past the session of the CE group of cfguard.ce"},
		{name: "settled", settled: settled, want: "between two generations"},
	} {
		err := s.caughtUp(tc.settled)
		if !errors.Is(err, ErrRebuilding) || !strings.Contains(fmt.Sprint(err), tc.want) {
			t.Errorf("%s: caughtUp = %v, want ErrRebuilding saying %q", tc.name, err, tc.want)
		}
	}
	if err := s.CaughtUp(context.Background(), 10*time.Millisecond); !errors.Is(err, ErrRebuilding) || !strings.Contains(err.Error(), "paused past") {
		t.Errorf("CaughtUp of a member that never settled = %v, want ErrRebuilding saying it was paused past its session", err)
	}
}

// An audit that failed somewhere is classified by what every failure was: all of them audits
// running there is ErrPeerBusy (409); all of them partitions not rebuilt is ErrRebuilding (503),
// or ErrBlocked when one of those is blocked (it waits for an upgrade, not a moment); anything
// else, or a mixture, is ErrPeer (502). The error names each failure, by replica id in order, and
// the replicas where the audit ran.
func TestAuditFailureClassifies(t *testing.T) {
	busy := fmt.Errorf("%w: at r1", ErrPeerBusy)
	rebuild := fmt.Errorf("%w: partition 2 at r2", ErrRebuilding)
	blocked := blockedError("partition 3 at r3 blocked at offset 9")
	peer := fmt.Errorf("%w: r4 refused the connection", ErrPeer)
	other := errors.New("r5 answered 500")
	for _, c := range []struct {
		name   string
		failed map[string]error
		want   error
		not    []error // the other kinds it must not match
	}{
		{"one busy", map[string]error{"r1": busy}, ErrPeerBusy, []error{ErrRebuilding, ErrBlocked, ErrPeer}},
		{"all busy", map[string]error{"r1": busy, "r9": busy}, ErrPeerBusy, []error{ErrRebuilding, ErrBlocked, ErrPeer}},
		{"one rebuilding", map[string]error{"r2": rebuild}, ErrRebuilding, []error{ErrPeerBusy, ErrBlocked, ErrPeer}},
		{"rebuilding and blocked", map[string]error{"r2": rebuild, "r3": blocked}, ErrBlocked, []error{ErrPeerBusy, ErrPeer}},
		{"one blocked", map[string]error{"r3": blocked}, ErrBlocked, []error{ErrPeerBusy, ErrPeer}},
		{"busy and rebuilding", map[string]error{"r1": busy, "r2": rebuild}, ErrPeer, []error{ErrPeerBusy, ErrRebuilding, ErrBlocked}},
		{"blocked and unreachable", map[string]error{"r3": blocked, "r4": peer}, ErrPeer, []error{ErrPeerBusy, ErrRebuilding, ErrBlocked}},
		{"another error", map[string]error{"r5": other}, ErrPeer, []error{ErrPeerBusy, ErrRebuilding, ErrBlocked}},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := auditFailure(c.failed, []string{"r0", "r6"})
			if !errors.Is(err, c.want) {
				t.Errorf("auditFailure = %v, want it to match %v", err, c.want)
			}
			for _, n := range c.not {
				if errors.Is(err, n) {
					t.Errorf("auditFailure = %v matches %v too", err, n)
				}
			}
			msg := err.Error()
			last := -1
			for _, r := range []string{"r1", "r2", "r3", "r4", "r5", "r9"} {
				f, ok := c.failed[r]
				if !ok {
					continue
				}
				i := strings.Index(msg, r+": "+f.Error())
				if i < 0 || i < last {
					t.Errorf("auditFailure = %q, want %q's failure named after the ones before it", msg, r)
				}
				last = i
			}
			if !strings.HasSuffix(msg, `it ran at ["r0" "r6"]`) {
				t.Errorf("auditFailure = %q, want it to end with where the audit ran", msg)
			}
		})
	}
}
