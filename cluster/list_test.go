package cluster

import (
	"slices"
	"testing"

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
