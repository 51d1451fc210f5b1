package command

import (
	"fmt"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/postlog"
)

// TestCheckEvents: verify-log compares the posterior events an increment carries with those of
// its re-executed step, type by type, each naming the entry; an entry that says nothing of
// events (a build that did not record them) is not judged.
func TestCheckEvents(t *testing.T) {
	ev := func(typ string, entry int) postlog.Event {
		return postlog.Event{Key: typ, Value: []byte(fmt.Sprintf(`{"type":%q,"log_entry":%d}`, typ, entry))}
	}
	for _, tc := range []struct {
		name    string
		events  []postlog.Event
		through uint64
		want    []string
		why     string
	}{
		{"quiet step, quiet entry", nil, 6, nil, ""},
		{"an old entry says nothing", nil, 0, []string{"kl_over_budget"}, ""},
		{"held", []postlog.Event{ev("kl_over_budget", 7), ev("increment_held", 7)}, 6, []string{"kl_over_budget", "increment_held"}, ""},
		{"missing breach", nil, 6, []string{"kl_over_budget"}, "events [], the step has [kl_over_budget]"},
		{"invented breach", []postlog.Event{ev("kl_over_budget", 7)}, 6, nil, "events [kl_over_budget], the step has []"},
		{"another entry's", []postlog.Event{ev("update_failed", 5)}, 6, []string{"update_failed"}, "its update_failed event names entry 5"},
		{"not JSON", []postlog.Event{{Key: "x", Value: []byte(`"x"`)}}, 6, nil, "not JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &postlog.Entry{Kind: postlog.Increment, Seq: 7, Events: tc.events, EventsThrough: tc.through}
			why := checkEvents(e, tc.want...)
			if (tc.why == "") != (why == "") || !strings.Contains(why, tc.why) {
				t.Errorf("checkEvents = %q, want %q", why, tc.why)
			}
		})
	}
}
