package daemon

import (
	"encoding/json"
	"testing"

	"github.com/cfguard/cfguard/stream"
)

// A held record produced again as docs/RUNBOOK.md (CfguardKLOverBudget) says, its held entry
// without partition and offset, is a record the consumer accepts, with the id its producer gave
// it. A record produced without an id is named "<topic>/<partition>/<offset>" by the consumer,
// which is no record id (bad_id): its entry carries none, so that it is produced again without.
func TestHeldEntryIsTheRecordProducedAgain(t *testing.T) {
	schema, err := stream.NewSchema([]string{"a", "b"}, []string{"no", "yes"}, 0)
	if err != nil {
		t.Fatal(err)
	}
	inc := &stream.Increment{Records: []stream.Record{
		{ID: "r1", X: []float64{1, 2}, Label: 1, Partition: 0, Offset: 6},
		{ID: stream.DefaultID("cfguard.records", 0, 7), X: []float64{3, 4}, Label: 0, Partition: 0, Offset: 7},
	}}
	for i, h := range heldRecords(inc) {
		b, err := json.Marshal(h)
		if err != nil {
			t.Fatal(err)
		}
		var entry map[string]any
		if err := json.Unmarshal(b, &entry); err != nil {
			t.Fatal(err)
		}
		delete(entry, "partition") // the runbook's jq: {id, features, "label": .label}
		delete(entry, "offset")
		if _, ok := entry["id"]; !ok {
			entry["id"] = nil // jq gives a missing member as null
		}
		again, err := json.Marshal(entry)
		if err != nil {
			t.Fatal(err)
		}
		rec, err := schema.Decode(again)
		if err != nil {
			t.Fatalf("held entry %s produced again as %s: %v", b, again, err)
		}
		want := inc.Records[i]
		if i == 1 {
			want.ID = "" // the consumer names it by where it is read again
		}
		if rec.ID != want.ID || rec.Label != want.Label || rec.X[0] != want.X[0] || rec.X[1] != want.X[1] {
			t.Errorf("held entry %s produced again decodes as %+v, want %+v", b, rec, want)
		}
	}
}
