package cluster

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// ErrPeer is matched (errors.Is) by the failures of another replica to answer a request this
// one made on a client's behalf: the API answers 502.
var ErrPeer = errors.New("a replica did not answer")

// listPage is one owner's page of GET /v1/counterfactuals: its CEs after the cursor, in id order,
// whether it has more after them, and the id of the last CE it returned (before the CEs of
// partitions it does not own were left out).
type listPage struct {
	ces    []*ledger.CE
	more   bool
	lastID string
}

func newListPage(ces []*ledger.CE, more bool) listPage {
	pg := listPage{ces: ces, more: more}
	if len(ces) > 0 {
		pg.lastID = ces[len(ces)-1].ID
	}
	return pg
}

// List answers GET /v1/counterfactuals on a replica for the whole cluster: it asks the owner of
// every CE partition (this ledger for its own, the others' APIs with the request's Authorization
// for theirs) for limit CEs of status st after the cursor after, keeps of each answer the CEs of
// the partitions the group gives that owner (a ledger may still hold a partition it is handing
// over), and merges them by id. An owner with more than a page bounds the merge: no CE past the
// last id it returned is taken, since its next CEs may come before them. So the page is the
// first limit CEs of the cluster in id order, as a single daemon's is, and next ("" at the
// end) resumes after it. A partition without an owner (the CE group is rebalancing) fails with
// ceshare.ErrNoOwner; an owner that does not answer fails the list, naming it.
func (s *Share) List(ctx context.Context, st certify.Status, limit int, after, authorization string) ([]*ledger.CE, string, error) {
	owners, err := s.dir.Owners(ctx)
	if err != nil {
		return nil, "", err
	}
	mine := partitionsOf(owners)
	got, failed := askOwners(owners, func(o ceshare.Owner) (listPage, error) {
		pg, err := s.listAt(ctx, o, mine[o.Replica], st, limit, after, authorization)
		pg.ces = ownedBy(pg.ces, o.Replica, owners, s.partitions)
		return pg, err
	})
	if err := firstFailure(failed); err != nil {
		return nil, "", err
	}
	next, cursor := mergePages(slices.Collect(maps.Values(got)), limit)
	return next, cursor, nil
}

// partitionsOf is, by replica id, the partitions owners gives each replica, in order.
func partitionsOf(owners map[int]ceshare.Owner) map[string][]int {
	mine := map[string][]int{}
	for p, o := range owners {
		mine[o.Replica] = append(mine[o.Replica], p)
	}
	for _, ps := range mine {
		slices.Sort(ps)
	}
	return mine
}

// ownedBy keeps, of the CEs replica answered with, those whose partition (of partitions) owners
// gives to it: a ledger may still hold CEs of a partition it is handing over, which its new owner
// answers for.
func ownedBy(ces []*ledger.CE, replica string, owners map[int]ceshare.Owner, partitions int) []*ledger.CE {
	return slices.DeleteFunc(ces, func(ce *ledger.CE) bool {
		return owners[ceshare.Partition(ce.ID, partitions)].Replica != replica
	})
}

// mergePages merges owners' pages (each in id order) into the first limit CEs in id order, and
// the cursor after them ("" when no owner has more and nothing was left out).
func mergePages(pages []listPage, limit int) ([]*ledger.CE, string) {
	bound, bounded := "", false // the smallest last id of an owner with more
	var all []*ledger.CE
	for _, pg := range pages {
		all = append(all, pg.ces...)
		if pg.more && (!bounded || pg.lastID < bound) {
			bound, bounded = pg.lastID, true
		}
	}
	slices.SortFunc(all, func(a, b *ledger.CE) int { return strings.Compare(a.ID, b.ID) })
	if bounded {
		all = slices.DeleteFunc(all, func(ce *ledger.CE) bool { return ce.ID > bound })
	}
	switch {
	case len(all) > limit, len(all) == limit && bounded:
		all = all[:limit]
		return all, all[limit-1].ID
	case bounded:
		return all, bound
	}
	return all, ""
}

// listAt reads one page of the CEs stored at owner o, which the group gives partitions parts:
// this ledger's, or o's API's (forwarded, naming parts, so that an owner that has not taken
// them all up yet answers 503 rather than a page without their CEs).
func (s *Share) listAt(ctx context.Context, o ceshare.Owner, parts []int, st certify.Status, limit int, after, authorization string) (listPage, error) {
	if o.Replica == s.id {
		if err := s.HoldsWhole(parts); err != nil {
			return listPage{}, err
		}
		ces, more, err := s.ledger.Page(st, limit, after)
		if err != nil {
			return listPage{}, err
		}
		return newListPage(ces, more), nil
	}
	q := url.Values{"limit": {strconv.Itoa(limit)}}
	var ps []string
	for _, p := range parts {
		ps = append(ps, strconv.Itoa(p))
	}
	q.Set(ParamPartitions, strings.Join(ps, ","))
	if after != "" {
		q.Set("after", after)
	}
	if st != 0 {
		q.Set("status", st.String())
	}
	a, err := s.ask(ctx, o, http.MethodGet, "/v1/counterfactuals?"+q.Encode(), nil, authorization)
	if errors.Is(err, errAnswerTooLarge) && limit > 1 {
		// CEs of many features: a smaller page of this owner's bounds the merge as well
		// (mergePages), and the next page resumes after it.
		return s.listAt(ctx, o, parts, st, limit/2, after, authorization)
	}
	if err != nil {
		return listPage{}, err
	}
	var got struct {
		CEs  []*ledger.CE `json:"counterfactuals"`
		Next string       `json:"next"`
	}
	if err := decodePeer(o, a, &got); err != nil {
		return listPage{}, err
	}
	return newListPage(got.CEs, got.Next != ""), nil
}
