package daemon

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/ledger"
)

// A CE's ETag is its registration's tag (ledger.CE.Tag), quoted: GET /v1/counterfactuals/{id}
// and a registration's 201 carry it, and DELETE with If-Match deletes the CE only while the id
// holds a registration it names. A DELETE sent again without its Idempotency-Key after the id
// was registered anew then keeps the new registration (412) instead of deleting it.

// errPrecondition: a deletion's If-Match named none of the registration stored under its id
// (ledger.OutcomeMismatch); answered 412.
var errPrecondition = errors.New("precondition failed")

// etag is ce's ETag header value: its tag as a strong entity tag.
func etag(ce *ledger.CE) string { return `"` + ce.Tag() + `"` }

// setETag sets ce's ETag on w (nothing for a nil ce).
func setETag(w http.ResponseWriter, ce *ledger.CE) {
	if ce != nil {
		w.Header().Set("ETag", etag(ce))
	}
}

// ifMatch is an If-Match header (RFC 9110, 13.1.1): "*", or a list of entity tags.
type ifMatch struct {
	any bool // "*": holds for any current representation
	// strong are the opaque tags of the list's strong entity tags, without quotes, in the
	// order sent. Its weak tags are not kept: If-Match compares strongly, so a weak tag matches
	// nothing, and a list of weak tags alone holds for no representation.
	strong []string
}

// parseIfMatch reads the If-Match header fields of a request: nil when there is none. A field
// is a comma-separated list (empty elements allowed) of entity tags, W/"..." or "...", whose
// opaque part is any bytes but DQUOTE, controls and space (etagc: %x21 / %x23-7E / %x80-FF),
// commas included, or "*" alone. Anything else is an error naming the header: "*" beside
// entity tags, an unquoted tag, a quote inside a tag, a lower-case w/.
func parseIfMatch(fields []string) (*ifMatch, error) {
	if len(fields) == 0 {
		return nil, nil
	}
	bad := func(why string) error {
		return fmt.Errorf("If-Match %q: %s; send \"*\" or the ETag of GET /v1/counterfactuals/{id}, quoted", strings.Join(fields, ", "), why)
	}
	m, n := &ifMatch{}, 0 // n counts the elements, "*" and weak tags included
	for _, f := range fields {
		for rest := f; ; {
			rest = strings.TrimLeft(rest, " \t,")
			if rest == "" {
				break
			}
			var el string
			switch {
			case rest[0] == '*':
				el, rest = "*", rest[1:]
				m.any = true
			case strings.HasPrefix(rest, `"`) || strings.HasPrefix(rest, `W/"`):
				weak := rest[0] == 'W'
				open := strings.IndexByte(rest, '"')
				end := strings.IndexByte(rest[open+1:], '"')
				if end < 0 {
					return nil, bad(fmt.Sprintf("%q has no closing quote", rest))
				}
				el, rest = rest[:open+1+end+1], rest[open+1+end+1:]
				opaque := el[open+1 : len(el)-1]
				if i := strings.IndexFunc(opaque, func(r rune) bool { return r <= ' ' || r == 0x7f }); i >= 0 {
					return nil, bad(fmt.Sprintf("%q: an entity tag holds no space or control character", el))
				}
				if !weak {
					m.strong = append(m.strong, opaque)
				}
			default:
				end := strings.IndexAny(rest, ", \t")
				if end < 0 {
					end = len(rest)
				}
				return nil, bad(fmt.Sprintf("%q is not an entity tag", rest[:end]))
			}
			n++
			// An element ends at a comma, after optional white space.
			if after := strings.TrimLeft(rest, " \t"); after != "" && after[0] != ',' {
				return nil, bad(fmt.Sprintf("%q runs on after %q without a comma", after, el))
			}
		}
	}
	switch {
	case n == 0:
		return nil, bad("no entity tag")
	case m.any && n > 1: // If-Match = "*" / #entity-tag
		return nil, bad("* stands alone, without entity tags beside it")
	}
	return m, nil
}

// holds says whether the condition holds for a representation: tag its entity tag without
// quotes ("" for none), exists whether the target has one. "*" holds when it exists; a list,
// when one of its strong tags is tag.
func (m *ifMatch) holds(tag string, exists bool) bool {
	if m.any {
		return exists
	}
	return exists && tag != "" && slices.Contains(m.strong, tag)
}

// noTag stands in a deletion's tags (ceTags) for a list none of whose entity tags can be a
// CE's: the empty entity tag, quoted, which no registration's tag equals.
const noTag = `""`

// ceTags are the tags a deletion conditioned by m passes on (ledger.DeleteRequest,
// ceshare.Request.IfMatch): ledger.AnyTag for "*"; else the distinct strong tags that can be a
// CE's tag (ledger.IsTag), sorted, so that the same tags in another order are the same request;
// noTag when there is none, so that the deletion still deletes nothing. Tags that cannot be a
// CE's tag match no CE and are dropped. More than ceshare.MaxIfMatch of them is an error.
func (m *ifMatch) ceTags() ([]string, error) {
	if m.any {
		return []string{ledger.AnyTag}, nil
	}
	var tags []string
	for _, t := range m.strong {
		if ledger.IsTag(t) {
			tags = append(tags, t)
		}
	}
	slices.Sort(tags)
	tags = slices.Compact(tags)
	switch {
	case len(tags) == 0:
		return []string{noTag}, nil
	case len(tags) > ceshare.MaxIfMatch:
		return nil, fmt.Errorf("If-Match names %d registration tags: a deletion names at most %d", len(tags), ceshare.MaxIfMatch)
	}
	return tags, nil
}

// ifMatchHolds evaluates a request's If-Match header fields (parseIfMatch; ok when there is
// none) against a representation (ifMatch.holds). err is parseIfMatch's, for a header that is
// not of that form.
func ifMatchHolds(fields []string, tag string, exists bool) (ok bool, err error) {
	m, err := parseIfMatch(fields)
	if err != nil || m == nil {
		return err == nil, err
	}
	return m.holds(tag, exists), nil
}

// evaluatesIfMatch says whether the handler of route pattern evaluates If-Match itself, against
// its answer's ETag.
func evaluatesIfMatch(pattern string) bool {
	switch pattern {
	case "GET /v1/counterfactuals/{id}", "DELETE /v1/counterfactuals/{id}", "GET /v1/model/posterior", "GET /v1/model/posterior/sidecar":
		return true
	}
	return false
}

// conditional evaluates r's If-Match on a route that does not evaluate it itself (every /v1/
// route but a CE's GET and DELETE and the posterior's): answers there carry no entity tag, so
// no tag named matches, and "*" holds when the path has a representation (represented: a GET
// route serves it), as RFC 9110 (13.1.1) says. A condition that fails is 412 and the request is
// not performed: ignored, the header would let POST /v1/explain, :bulk or /v1/audit act on a
// condition that does not hold. A header that is not of the form is 400.
func conditional(h http.Handler, represented bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fields := r.Header.Values("If-Match")
		if len(fields) == 0 {
			h.ServeHTTP(w, r)
			return
		}
		ok, err := ifMatchHolds(fields, "", represented)
		switch {
		case err != nil:
			writeError(w, http.StatusBadRequest, err.Error())
		case !ok:
			what := "no entity tag to match"
			if !represented {
				what = "no representation, so neither * nor an entity tag matches"
			}
			writeError(w, http.StatusPreconditionFailed, fmt.Sprintf("%v: If-Match %q: %s %s has %s; nothing was done (GET and DELETE "+
				"/v1/counterfactuals/{id} evaluate If-Match against the CE's ETag)", errPrecondition, strings.Join(fields, ", "), r.Method, r.URL.Path, what))
		default:
			h.ServeHTTP(w, r)
		}
	})
}
