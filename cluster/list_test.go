package cluster

import (
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// TestMergePages holds the merge of owners' pages to the first limit CEs of their union in id
// order, whatever an owner left out of its own page.
func TestMergePages(t *testing.T) {
	ces := func(ids ...string) []*ledger.CE {
		var out []*ledger.CE
		for _, id := range ids {
			out = append(out, &ledger.CE{ID: id})
		}
		return out
	}
	for _, c := range []struct {
		name  string
		pages []listPage
		limit int
		want  []string
		next  string
	}{
		{"every owner done", []listPage{newListPage(ces("b", "d"), false), newListPage(ces("a", "c"), false)}, 3, []string{"a", "b", "c"}, "c"},
		{"fewer than a page, nobody has more", []listPage{newListPage(ces("b"), false), newListPage(ces("a"), false)}, 3, []string{"a", "b"}, ""},
		{"an owner with more bounds the page", []listPage{newListPage(ces("a", "b", "c"), true), newListPage(ces("d"), false)}, 3, []string{"a", "b", "c"}, "c"},
		{"the bound leaves another owner's later CEs for the next page",
			[]listPage{newListPage(ces("a", "e"), true), newListPage(ces("b"), false)}, 2, []string{"a", "b"}, "b"},
		{"an owner's page emptied by ownership: the cursor still moves past it",
			[]listPage{{more: true, lastID: "m"}, newListPage(ces("z"), false)}, 2, nil, "m"},
		{"exactly a page, nobody has more: the last page", []listPage{newListPage(ces("b"), false), newListPage(ces("a", "c"), false)}, 3, []string{"a", "b", "c"}, ""},
		{"exactly a page, an owner has more", []listPage{newListPage(ces("b"), false), newListPage(ces("a", "c"), true)}, 3, []string{"a", "b", "c"}, "c"},
		{"nothing stored", []listPage{newListPage(nil, false)}, 5, nil, ""},
		{"of owners with more, the smallest last id bounds the page, whichever answered first",
			[]listPage{newListPage(ces("b", "c"), true), newListPage(ces("a", "d"), true)}, 5, []string{"a", "b", "c"}, "c"},
		{"an owner with more that returned a single CE bounds the page at it",
			[]listPage{newListPage(ces("b"), true), newListPage(ces("a", "c"), false)}, 3, []string{"a", "b"}, "b"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, next := mergePages(c.pages, c.limit)
			var ids []string
			for _, ce := range got {
				ids = append(ids, ce.ID)
			}
			if !slices.Equal(ids, c.want) || next != c.next {
				t.Errorf("mergePages = %v, next %q; want %v, next %q", ids, next, c.want, c.next)
			}
		})
	}
}

// A list asks each owner for the partitions the group gives it, in order, and keeps of its answer
// only the CEs of those partitions: a CE of a partition another replica owns (one still being
// handed over) or no replica owns (a rebalance) is that owner's to answer, or nobody's.
func TestListKeepsWhatEachOwnerOwns(t *testing.T) {
	const partitions = 16
	owners := map[int]ceshare.Owner{} // 15: none
	wantParts := map[string][]int{}
	for p := range partitions - 1 {
		r := []string{"r1", "r1", "r2"}[p%3]
		owners[p] = ceshare.Owner{Replica: r}
		wantParts[r] = append(wantParts[r], p)
	}
	if got := partitionsOf(owners); !reflect.DeepEqual(got, wantParts) {
		t.Errorf("partitionsOf = %v, want %v", got, wantParts)
	}
	var all []*ledger.CE
	want := map[string][]string{}
	for i := range 200 {
		id := fmt.Sprintf("ce-%03d", i)
		all = append(all, &ledger.CE{ID: id})
		if o, ok := owners[ceshare.Partition(id, partitions)]; ok {
			want[o.Replica] = append(want[o.Replica], id)
		}
	}
	if len(want["r1"]) == 0 || len(want["r2"]) == 0 || len(want["r1"])+len(want["r2"]) == len(all) {
		t.Fatalf("the ids do not fall in every kind of partition: %v", want)
	}
	for _, r := range []string{"r1", "r2", "r3"} {
		var got []string
		for _, ce := range ownedBy(slices.Clone(all), r, owners, partitions) {
			got = append(got, ce.ID)
		}
		if !slices.Equal(got, want[r]) {
			t.Errorf("ownedBy(%s) = %v, want %v", r, got, want[r])
		}
	}
}
