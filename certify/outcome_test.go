package certify

import (
	"encoding/json"
	"testing"
)

func TestOutcomes(t *testing.T) {
	seen := map[Outcome]bool{}
	for _, o := range Outcomes() {
		if !o.Valid() || seen[o] {
			t.Fatalf("outcome %q invalid or repeated", o)
		}
		seen[o] = true
		back, err := ParseOutcome(o.String())
		if err != nil || back != o {
			t.Fatalf("ParseOutcome(%q) = %q, %v", o, back, err)
		}
		js, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		var got Outcome
		if err := json.Unmarshal(js, &got); err != nil || got != o {
			t.Fatalf("JSON round trip of %q: %q, %v", o, got, err)
		}
	}
	if len(seen) != 4 {
		t.Fatalf("%d outcomes, want 4", len(seen))
	}
	for _, bad := range []string{"", "Promoted", "step", "accepted"} {
		if _, err := ParseOutcome(bad); err == nil {
			t.Errorf("ParseOutcome(%q) accepted", bad)
		}
		var o Outcome
		if err := o.UnmarshalText([]byte(bad)); err == nil {
			t.Errorf("UnmarshalText(%q) accepted", bad)
		}
	}
	if _, err := json.Marshal(Outcome("nope")); err == nil {
		t.Error("marshalling an invalid outcome succeeded")
	}
}
