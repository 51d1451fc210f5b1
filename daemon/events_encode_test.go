package daemon

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
)

// decodeEntry is the event an outbox entry's value holds, and its "at" as written.
func decodeEntry(t *testing.T, oe ledger.OutboxEntry) (Event, string) {
	t.Helper()
	var e Event
	if err := json.Unmarshal(oe.Value, &e); err != nil {
		t.Fatalf("entry %s: %v", oe.Value, err)
	}
	var raw struct {
		At string `json:"at"`
	}
	if err := json.Unmarshal(oe.Value, &raw); err != nil {
		t.Fatal(err)
	}
	return e, raw.At
}

// A status change goes into the outbox as a status_changed event keyed by the CE's id that
// carries the change as the ledger recorded it: its time (not restamped), from and to, the
// posterior version, KL, bound, var_bound, p2 when set, and decided (false included) with
// verdict_pending and renewal_pending.
func TestStatusChangedCarriesTheChange(t *testing.T) {
	at := time.Date(2026, 3, 4, 5, 6, 7, 8, time.UTC)
	p2 := 0.7
	yes, no := true, false
	lapsed := uint64(11)
	f := func(v float64) *float64 { return &v }
	for _, tc := range []struct {
		ch   ledger.StatusChange
		want Event
	}{
		{ledger.StatusChange{ID: "ce-1", At: at, From: certify.AtRisk, To: certify.Certified, PosteriorVersion: 8, KL: 0.03, Bound: 0.98, VarBound: 0.01, P2: &p2, Decided: true},
			Event{Type: "status_changed", ID: "ce-1", From: certify.AtRisk.String(), To: certify.Certified.String(), PosteriorVersion: 8, KL: f(0.03), Bound: f(0.98), VarBound: f(0.01), P2: f(0.7), Decided: &yes}},
		{ledger.StatusChange{ID: "ce-2", At: at, From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 9, KL: 0.1, Bound: 0.4, VarBound: 0.02, VerdictPending: true},
			Event{Type: "status_changed", ID: "ce-2", From: certify.Certified.String(), To: certify.AtRisk.String(), PosteriorVersion: 9, KL: f(0.1), Bound: f(0.4), VarBound: f(0.02), Decided: &no, VerdictPending: true}},
		{ledger.StatusChange{ID: "ce-3", At: at, From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 10, KL: 0, Bound: 0.3, VarBound: 0.03, RenewalPending: true},
			Event{Type: "status_changed", ID: "ce-3", From: certify.Certified.String(), To: certify.AtRisk.String(), PosteriorVersion: 10, KL: f(0), Bound: f(0.3), VarBound: f(0.03), Decided: &no, RenewalPending: true}},
		{ledger.StatusChange{ID: "ce-4", At: at, From: certify.Certified, To: certify.Invalidated, PosteriorVersion: 12, KL: 0.2, Bound: 0.2, VarBound: 0.05, P2: &p2, Decided: true, LapsedSince: &lapsed},
			Event{Type: "status_changed", ID: "ce-4", From: certify.Certified.String(), To: certify.Invalidated.String(), PosteriorVersion: 12, KL: f(0.2), Bound: f(0.2), VarBound: f(0.05), P2: f(0.7), Decided: &yes, LapsedSince: &lapsed}},
	} {
		oe := encodeChange(tc.ch)
		got, _ := decodeEntry(t, oe)
		if oe.Key != tc.ch.ID || !got.At.Equal(at) {
			t.Errorf("%s: key %q, at %v; want %q, %v", tc.ch.ID, oe.Key, got.At, tc.ch.ID, at)
		}
		got.At = time.Time{}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: encoded as %s; want %+v", tc.ch.ID, oe.Value, tc.want)
		}
	}
}

// An event's key is the CE's id when it is about one CE, else its type; a zero At is stamped
// with the time given, in UTC, or with the current time when none is given; a set At is kept.
func TestEventEntryKeyAndTime(t *testing.T) {
	set := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	now := time.Date(2026, 6, 7, 8, 9, 10, 11, time.FixedZone("UTC+2", 2*3600))
	for _, tc := range []struct {
		name    string
		e       Event
		now     time.Time
		wantKey string
		wantAt  time.Time // zero: any time but the zero one
	}{
		{"no id, no time", Event{Type: "audit_completed"}, now, "audit_completed", now},
		{"an id, a time", Event{Type: "counterfactual_reissued", ID: "ce-7", At: set}, now, "ce-7", set},
		{"no time given", Event{Type: "kl_over_budget"}, time.Time{}, "kl_over_budget", time.Time{}},
	} {
		oe := tc.e.entry(tc.now)
		got, raw := decodeEntry(t, oe)
		if oe.Key != tc.wantKey {
			t.Errorf("%s: key %q, want %q", tc.name, oe.Key, tc.wantKey)
		}
		if !strings.HasSuffix(raw, "Z") || got.At.IsZero() || (!tc.wantAt.IsZero() && !got.At.Equal(tc.wantAt)) {
			t.Errorf("%s: at %q; want %v in UTC", tc.name, raw, tc.wantAt)
		}
	}
}

// An event that a non-finite number makes unencodable is sent without its numbers, keeping
// everything else that says what happened, and says why in its error.
func TestUnencodableEventKeepsItsWords(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	nan, yes := math.NaN(), true
	e := Event{Type: "status_changed", At: at, ID: "ce-1", From: "at_risk", To: "certified", PosteriorVersion: 3, KL: &nan, Bound: &nan,
		Decided: &yes, VerdictPending: true, RenewalPending: true, Policy: "reject", Records: []string{"r1"}}
	got, _ := decodeEntry(t, e.entry(time.Time{}))
	if !strings.Contains(got.Error, "not encodable as JSON") || got.KL != nil || got.Bound != nil {
		t.Fatalf("decoded %+v; want no numbers and an error saying why", got)
	}
	got.Error = ""
	want := e
	want.KL, want.Bound = nil, nil
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded %+v; want %+v", got, want)
	}
}

// An event of at most the limit is encoded whole. A larger one drops the records it lists,
// keeps or gains the offsets (per partition in order, the first and last) that name them, and
// appends to its error how many records were omitted.
func TestEventOverTheLimitNamesItsRecordsByOffset(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	failed := Event{Type: "update_failed", At: at, Records: []string{"a", "b", "c"}, Offsets: []offsetRange{{0, 5, 9}}, Error: "non-finite loss"}
	v, err := json.Marshal(failed)
	if err != nil {
		t.Fatal(err)
	}
	var held []heldRecord
	for p := 19; p >= 0; p-- { // partitions out of order, offsets too
		for _, off := range []int64{7, 3, 9} {
			held = append(held, heldRecord{ID: fmt.Sprint(p, off), Partition: p, Offset: off})
		}
	}
	var heldOffsets []offsetRange
	for p := range 20 {
		heldOffsets = append(heldOffsets, offsetRange{p, 3, 9})
	}
	for _, tc := range []struct {
		name        string
		e           Event
		limit       int
		whole       bool
		wantOffsets []offsetRange
		wantError   string
	}{
		{"at the limit", failed, len(v), true, failed.Offsets, failed.Error},
		{"over the limit, records", failed, len(v) - 1, false, failed.Offsets,
			fmt.Sprintf("non-finite loss (event of %d bytes exceeds %d: the 3 records it would list are omitted; offsets names them in the input topic)", len(v), len(v)-1)},
		{"over the limit, held", Event{Type: "increment_held", At: at, Held: held}, 1000, false, heldOffsets, "the 60 records it would list are omitted"},
	} {
		got, _ := decodeEntry(t, tc.e.encode(time.Time{}, tc.limit))
		if tc.whole {
			if !reflect.DeepEqual(got, tc.e) {
				t.Errorf("%s: %+v, want it whole", tc.name, got)
			}
			continue
		}
		if len(got.Records) != 0 || len(got.Held) != 0 || !slices.Equal(got.Offsets, tc.wantOffsets) {
			t.Errorf("%s: records %v, held %d, offsets %+v; want none, none, %+v", tc.name, got.Records, len(got.Held), got.Offsets, tc.wantOffsets)
		}
		if !strings.Contains(got.Error, tc.wantError) || got.Error != strings.TrimSpace(got.Error) || !strings.HasPrefix(got.Error, tc.e.Error) {
			t.Errorf("%s: error %q; want %q after the event's own error, trimmed", tc.name, got.Error, tc.wantError)
		}
	}
}
