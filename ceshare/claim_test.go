package ceshare

import (
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/internal/ident"
)

// rec builders for the fold's table: a claim, a state and a tombstone as a cluster member signs
// them, and records another key signed.
func claimRec(t *testing.T, term int64, replica string, gen int32) record {
	t.Helper()
	return claimRecOf(t, 0, term, replica, gen)
}

// claimRecOf is a claim of partition p (the fold's table reads partition 0).
func claimRecOf(t *testing.T, p int, term int64, replica string, gen int32) record {
	t.Helper()
	k, v, err := EncodeClaim(Claim{Partition: p, Term: term, Replica: replica, Generation: gen})
	if err != nil {
		t.Fatal(err)
	}
	return record{key: k, value: v, auth: testKeys().Sign(ClaimDomain, v)}
}

func stateRec(t *testing.T, id, replica string, gen int32, label string) record {
	t.Helper()
	k, v, err := EncodeState(State{ID: id, Replica: replica, Generation: gen, CE: json.RawMessage(fmt.Sprintf(`{"s":%q}`, label))})
	if err != nil {
		t.Fatal(err)
	}
	return record{key: k, value: v, auth: testKeys().Sign(StateDomain, v)}
}

func tombRec(id string) record {
	return record{key: []byte(id), auth: testKeys().Sign(TombstoneDomain, []byte(id))}
}

// The fold of a partition of the CE state topic keeps, of each CE, the last state the claim in
// force owned when it was written; a state no claim owned (a previous owner's late write) is
// the CE's state only when no other is left. The claim in force is the greatest by (term,
// generation), whatever the order claims arrive in.
func TestFoldFencesLateWrites(t *testing.T) {
	for _, tc := range []struct {
		name   string
		recs   func(t *testing.T) []record
		want   map[string]string // id -> label of the state read
		fenced int64
	}{
		{"no claim: the last state of each CE, as before claims", func(t *testing.T) []record {
			return []record{stateRec(t, "a", "r1", 1, "a1"), stateRec(t, "a", "r2", 1, "a2"), stateRec(t, "b", "r1", 3, "b")}
		}, map[string]string{"a": "a2", "b": "b"}, 0},
		{"a late write after the next owner's claim: the owner's state before it", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"),
				claimRec(t, 2, "r2", 2), stateRec(t, "a", "r1", 1, "r1 late")}
		}, map[string]string{"a": "r1's"}, 1},
		{"the new owner's own write after a late one wins", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"),
				claimRec(t, 2, "r2", 2), stateRec(t, "a", "r1", 1, "r1 late"), stateRec(t, "a", "r2", 2, "r2's")}
		}, map[string]string{"a": "r2's"}, 1},
		{"only a late write is left (compaction removed the one before): it is used", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), claimRec(t, 2, "r2", 2), stateRec(t, "a", "r1", 1, "r1 late")}
		}, map[string]string{"a": "r1 late"}, 1},
		{"a tombstone after a late write removes the CE", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"),
				claimRec(t, 2, "r2", 2), stateRec(t, "a", "r1", 1, "r1 late"), tombRec("a")}
		}, map[string]string{}, 1},
		{"a late write after a tombstone does not bring the deleted CE back", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"),
				claimRec(t, 2, "r2", 2), tombRec("a"), stateRec(t, "a", "r1", 1, "r1 late")}
		}, map[string]string{}, 1},
		{"... until its owner writes it again (registered again)", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), tombRec("a"), stateRec(t, "a", "r1", 1, "again"),
				claimRec(t, 2, "r2", 2), stateRec(t, "a", "r1", 1, "r1 late")}
		}, map[string]string{"a": "again"}, 1},
		{"a claim of a lower term read later (its writer paused before sending it) is not in force", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), claimRec(t, 3, "r3", 4), claimRec(t, 2, "r2", 3),
				stateRec(t, "a", "r3", 4, "r3's"), stateRec(t, "b", "r2", 3, "r2 late")}
		}, map[string]string{"a": "r3's", "b": "r2 late"}, 1},
		{"a claim of a lower term but a later generation, read later, is not in force", func(t *testing.T) []record {
			// Generations start again when the group is removed: a lower term's claim may name a
			// later generation than the claim in force.
			return []record{claimRec(t, 4, "r1", 40), claimRec(t, 5, "r2", 1), claimRec(t, 4, "r3", 41),
				stateRec(t, "a", "r2", 1, "r2's"), stateRec(t, "b", "r3", 41, "r3 late")}
		}, map[string]string{"a": "r2's", "b": "r3 late"}, 1},
		{"two claims of one term: the later generation is in force", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), claimRec(t, 2, "r3", 5), claimRec(t, 2, "r2", 4),
				stateRec(t, "a", "r3", 5, "r3's"), stateRec(t, "a", "r2", 4, "r2 late")}
		}, map[string]string{"a": "r3's"}, 1},
		{"after the group was removed, generations start again: a later term is in force", func(t *testing.T) []record {
			return []record{claimRec(t, 4, "r1", 40), stateRec(t, "a", "r1", 41, "old"), claimRec(t, 5, "r2", 1),
				stateRec(t, "a", "r2", 1, "new")}
		}, map[string]string{"a": "new"}, 0},
		{"the owner's state of a generation before its claim, read after it, is fenced", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 2), stateRec(t, "a", "r1", 2, "r1 g2"),
				claimRec(t, 2, "r2", 3), claimRec(t, 3, "r1", 4), stateRec(t, "a", "r1", 2, "r1 g2 outbox")}
		}, map[string]string{"a": "r1 g2"}, 1},
		{"a late write of the previous owner in the claim's generation is fenced", func(t *testing.T) []record {
			// Generations are the group's: the replica that lost the partition takes part in the
			// new owner's generation too.
			return []record{claimRec(t, 1, "r1", 4), stateRec(t, "a", "r1", 4, "r1's"), claimRec(t, 2, "r2", 5),
				stateRec(t, "a", "r2", 5, "r2's"), stateRec(t, "a", "r1", 5, "r1 late")}
		}, map[string]string{"a": "r2's"}, 1},
		{"two claims of one term and one generation: the one read later is in force", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), claimRec(t, 2, "r2", 3), claimRec(t, 2, "r3", 3),
				stateRec(t, "a", "r3", 3, "r3's"), stateRec(t, "b", "r2", 3, "r2 late")}
		}, map[string]string{"a": "r3's", "b": "r2 late"}, 1},
		{"an authenticated record that does not decode removes the CE's state, as compaction would", func(t *testing.T) []record {
			bad := record{key: []byte("a"), value: []byte("{"), auth: testKeys().Sign(StateDomain, []byte("{"))}
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"), stateRec(t, "b", "r1", 1, "b"), bad}
		}, map[string]string{"b": "b"}, 0},
		{"a CE its owner wrote again after a tombstone takes a later late write when its state is gone", func(t *testing.T) []record {
			bad := record{key: []byte("a"), value: []byte("{"), auth: testKeys().Sign(StateDomain, []byte("{"))}
			return []record{claimRec(t, 1, "r1", 1), tombRec("a"), stateRec(t, "a", "r1", 1, "again"), bad,
				claimRec(t, 2, "r2", 2), stateRec(t, "a", "r1", 1, "r1 late")}
		}, map[string]string{"a": "r1 late"}, 1},
		// Copies of signed records (docs/DESIGN.md, "What it does not stop"): authenticated, so
		// taken as what they say; the ACLs keep them out.
		{"a copy of the owner's earlier state, appended later, is the CE's state", func(t *testing.T) []record {
			early := stateRec(t, "a", "r1", 1, "early")
			return []record{claimRec(t, 1, "r1", 1), early, stateRec(t, "a", "r1", 1, "newer"), early}
		}, map[string]string{"a": "early"}, 0},
		{"a copy of a tombstone ends a CE registered again", func(t *testing.T) []record {
			tomb := tombRec("a")
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "first"), tomb,
				stateRec(t, "a", "r1", 1, "again"), tomb}
		}, map[string]string{}, 0},
		{"a copy of an earlier claim is not in force", func(t *testing.T) []record {
			c1 := claimRec(t, 1, "r1", 1)
			return []record{c1, claimRec(t, 2, "r2", 2), c1, stateRec(t, "a", "r1", 1, "r1 late")}
		}, map[string]string{"a": "r1 late"}, 1},
		{"a copy of another partition's claim, of a greater term, is not in force", func(t *testing.T) []record {
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"),
				claimRecOf(t, 1, 5, "r2", 7), stateRec(t, "a", "r1", 1, "r1's after the copy")}
		}, map[string]string{"a": "r1's after the copy"}, 0},
		{"a signed claim that names no partition (an earlier build's) is not in force", func(t *testing.T) []record {
			v := []byte(`{"term":5,"replica":"r2","generation":7}`)
			old := record{key: []byte("claim/5"), value: v, auth: testKeys().Sign(ClaimDomain, v)}
			return []record{claimRec(t, 1, "r1", 1), stateRec(t, "a", "r1", 1, "r1's"), old,
				stateRec(t, "a", "r1", 1, "r1's after it")}
		}, map[string]string{"a": "r1's after it"}, 0},
		{"a claim that does not authenticate is not in force", func(t *testing.T) []record {
			forged := claimRec(t, 9, "evil", 9)
			forged.auth = []byte("forged")
			return []record{claimRec(t, 1, "r1", 1), forged, stateRec(t, "a", "r1", 1, "r1's")}
		}, map[string]string{"a": "r1's"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := &Member{cfg: MemberConfig{Keys: testKeys(), StateTopic: testStateTopic}, log: testLog(t)}
			f := newStateFold()
			var term int64 // the greatest term of the authenticated claims: the next claim's is one more
			for i, r := range tc.recs(t) {
				r.offset = int64(i)
				m.foldState(f, 0, r)
				if c, err := DecodeClaim(0, r.key, r.value); err == nil && isClaim(r.key) && testKeys().Verify(ClaimDomain, r.value, r.auth) == nil {
					term = max(term, c.Term)
				}
			}
			if f.term != term {
				t.Errorf("the fold's greatest term is %d, want %d", f.term, term)
			}
			got := map[string]string{}
			for id, s := range f.result() {
				var ce struct{ S string }
				if err := json.Unmarshal(s.CE, &ce); err != nil {
					t.Fatal(err)
				}
				got[id] = ce.S
				if late := strings.Contains(ce.S, "late"); s.Late != late {
					t.Errorf("%s: state %q marked late %v, want %v", id, ce.S, s.Late, late)
				}
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("states %v, want %v", got, tc.want)
			}
			if s := m.Stats().States; s.Fenced != tc.fenced {
				t.Errorf("%d states fenced, want %d (%+v)", s.Fenced, tc.fenced, s)
			}
		})
	}
}

// A claim's encoding is checked both ways; a claim's key is never a CE id.
func TestClaimEncoding(t *testing.T) {
	want := Claim{Partition: 2, Term: 7, Replica: "r1", Generation: 3}
	k, v, err := EncodeClaim(want)
	if err != nil {
		t.Fatal(err)
	}
	if c, err := DecodeClaim(2, k, v); err != nil || c != want {
		t.Fatalf("round trip = %+v, %v", c, err)
	}
	if err := ident.Check(string(k)); err == nil {
		t.Errorf("claim key %q is a valid CE id", k)
	}
	for _, tc := range []struct {
		name, key, value, reason string
	}{
		{"not JSON", "claim/1", `{`, ReasonJSON},
		{"an unknown field", "claim/1", `{"partition":2,"term":1,"replica":"r1","generation":1,"x":1}`, ReasonJSON},
		{"term 0", "claim/0", `{"partition":2,"term":0,"replica":"r1","generation":1}`, ReasonTerm},
		{"no replica", "claim/1", `{"partition":2,"term":1,"generation":1}`, ReasonReplica},
		{"a blank replica", "claim/1", `{"partition":2,"term":1,"replica":" ","generation":1}`, ReasonReplica},
		{"another term's key", "claim/2", `{"partition":2,"term":1,"replica":"r1","generation":1}`, ReasonKey},
		{"no partition (an earlier build's claim)", "claim/1", `{"term":1,"replica":"r1","generation":1}`, ReasonPartition},
		{"another partition (a copy)", "claim/1", `{"partition":0,"term":1,"replica":"r1","generation":1}`, ReasonPartition},
		{"a negative partition", "claim/1", `{"partition":-2,"term":1,"replica":"r1","generation":1}`, ReasonPartition},
	} {
		_, err := DecodeClaim(2, []byte(tc.key), []byte(tc.value))
		if de, ok := err.(*DecodeError); !ok || de.Reason != tc.reason {
			t.Errorf("%s: %v; want reason %s", tc.name, err, tc.reason)
		}
	}
	if _, _, err := EncodeClaim(Claim{Term: 0, Replica: "r1"}); err == nil {
		t.Error("a claim of term 0 encoded")
	}
	if _, _, err := EncodeClaim(Claim{Partition: -1, Term: 1, Replica: "r1"}); err == nil {
		t.Error("a claim of partition -1 encoded")
	}
}
