package daemon

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/internal/ident"
	"github.com/cfguard/cfguard/ledger"
)

// Conditional requests (RFC 9110, 13). A CE's ETag is its registration's tag (ledger.CE.Tag),
// quoted: GET /v1/counterfactuals/{id} and a registration's 201 carry it, and DELETE with
// If-Match deletes the CE only while the id holds a registration it names. A DELETE sent again
// without its Idempotency-Key after the id was registered anew then keeps the new registration
// (412) instead of deleting it. The posterior's routes carry the SHA-256 of their body. Every
// /v1/ route evaluates If-Match and If-None-Match (preconditions), against its ETag or, where
// its answers carry none, against no entity tag; a CE's If-None-Match matches only "*", its tag
// not being a validator of the answer.

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

// entityTags is an If-Match or If-None-Match header (RFC 9110, 13.1.1 and 13.1.2): "*", or a
// list of entity tags.
type entityTags struct {
	any    bool     // "*": matches any current representation
	strong []string // the opaque tags of its strong entity tags, without quotes, in the order sent
	weak   []string // and of its weak ones (W/"..."), which only a weak comparison matches
}

// parseIfMatch reads the If-Match header fields of a request (parseEntityTags).
func parseIfMatch(fields []string) (*entityTags, error) { return parseEntityTags("If-Match", fields) }

// maxQuoted bounds what of a header an error quotes (a header may be a megabyte long).
const maxQuoted = 256

// parseEntityTags reads the fields of header name: nil when there is none. A field is a
// comma-separated list (empty elements allowed) of entity tags, W/"..." or "...", whose opaque
// part is any bytes but DQUOTE, controls and space (etagc: %x21 / %x23-7E / %x80-FF), commas
// included, or "*" alone. Anything else is an error naming the header: "*" beside entity tags,
// an unquoted tag, a quote inside a tag, a lower-case w/.
func parseEntityTags(name string, fields []string) (*entityTags, error) {
	if len(fields) == 0 {
		return nil, nil
	}
	bad := func(why string) error {
		return fmt.Errorf("%s %q: %s; send \"*\" or entity tags, quoted, as ETag gives them (a CE's: GET /v1/counterfactuals/{id})",
			name, ident.Clip(strings.Join(fields, ", "), maxQuoted), ident.Clip(why, maxQuoted))
	}
	m, n := &entityTags{}, 0 // n counts the elements, "*" included
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
				open := strings.IndexByte(rest, '"')
				end := strings.IndexByte(rest[open+1:], '"')
				if end < 0 {
					return nil, bad(fmt.Sprintf("%q has no closing quote", rest))
				}
				el, rest = rest[:open+1+end+1], rest[open+1+end+1:]
				opaque := el[open+1 : len(el)-1]
				if strings.ContainsFunc(opaque, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
					return nil, bad(fmt.Sprintf("%q: an entity tag holds no space or control character", el))
				}
				if open == 0 {
					m.strong = append(m.strong, opaque)
				} else {
					m.weak = append(m.weak, opaque)
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
	case m.any && n > 1: // "*" / #entity-tag
		return nil, bad("* stands alone, without entity tags beside it")
	}
	return m, nil
}

// holds is If-Match's condition for a representation: tag its entity tag without quotes (""
// for none), exists whether the target has one. "*" holds when it exists; a list, when one of
// its strong tags is tag (If-Match compares strongly: a weak tag matches nothing).
func (m *entityTags) holds(tag string, exists bool) bool {
	if m.any {
		return exists
	}
	return exists && tag != "" && slices.Contains(m.strong, tag)
}

// matchesWeakly is If-None-Match's match (its condition is that there is none): "*" matches
// when the representation exists; a list, when one of its tags, strong or weak, is tag (a weak
// comparison).
func (m *entityTags) matchesWeakly(tag string, exists bool) bool {
	if m.any {
		return exists
	}
	return exists && tag != "" && (slices.Contains(m.strong, tag) || slices.Contains(m.weak, tag))
}

// noTag stands in a deletion's tags (ceTags) for a list none of whose entity tags can be a
// CE's: the empty entity tag, quoted, which no registration's tag equals.
const noTag = `""`

// ceTags are the tags a deletion conditioned by m passes on (ledger.DeleteRequest,
// ceshare.Request.IfMatch): ledger.AnyTag for "*"; else the distinct strong tags that can be a
// CE's tag (ledger.IsTag), sorted, so that the same tags in another order are the same request;
// noTag when there is none, so that the deletion still deletes nothing. Tags that cannot be a
// CE's tag match no CE and are dropped. More than ceshare.MaxIfMatch of them is an error.
func (m *entityTags) ceTags() ([]string, error) {
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

// preconditions evaluates r's If-Match and then its If-None-Match (RFC 9110, 13.2.2) against
// the target's representation: tag its entity tag without quotes ("" for none), exists whether
// it has one. validates says whether tag changes whenever the answer's body does (a validator,
// RFC 9110 8.8.1: the posterior's SHA-256); a tag that does not (a CE's registration, whose
// status and bound change under it) is compared by If-Match only, and If-None-Match matches it
// only as "*": a 304 for it would have a client keep a body that no longer holds. It reports
// whether the method is to be performed; when not, it has answered: 400 for a header that is not
// "*" or entity tags, 412 for an If-Match that does not hold (failed says why, after
// "precondition failed: "), and for an If-None-Match that matches, 304 to a GET or HEAD (with
// the response's headers set so far, the ETag among them) and 412 to another method.
func preconditions(w http.ResponseWriter, r *http.Request, tag string, exists, validates bool, failed func() string) bool {
	im, err := parseIfMatch(r.Header.Values("If-Match"))
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return false
	}
	if im != nil && !im.holds(tag, exists) {
		writeError(w, http.StatusPreconditionFailed, fmt.Sprintf("%v: %s", errPrecondition, failed()))
		return false
	}
	inm, err := parseEntityTags("If-None-Match", r.Header.Values("If-None-Match"))
	if !validates {
		tag = ""
	}
	switch {
	case err != nil:
		writeError(w, http.StatusBadRequest, err.Error())
		return false
	case inm == nil || !inm.matchesWeakly(tag, exists):
		return true
	case r.Method == http.MethodGet || r.Method == http.MethodHead:
		w.WriteHeader(http.StatusNotModified)
	default:
		writeError(w, http.StatusPreconditionFailed, fmt.Sprintf("%v: If-None-Match %q matches %s %s's current representation; nothing was done",
			errPrecondition, ident.Clip(strings.Join(r.Header.Values("If-None-Match"), ", "), maxQuoted), r.Method, r.URL.Path))
	}
	return false
}

// evaluatesConditions says whether the handler of route pattern evaluates If-Match and
// If-None-Match itself: against its answer's ETag, or (the list) after its query, which it
// refuses first (RFC 9110, 13.2.1: a request refused without its conditions is refused with them).
func evaluatesConditions(pattern string) bool {
	switch pattern {
	case "GET /v1/counterfactuals/{id}", "DELETE /v1/counterfactuals/{id}", "GET /v1/model/posterior", "GET /v1/model/posterior/sidecar",
		"GET /v1/counterfactuals":
		return true
	}
	return false
}

// conditional evaluates r's If-Match and If-None-Match on a route that does not evaluate them
// itself (every /v1/ route but a CE's GET and DELETE, the posterior's and the list, which calls
// untaggedPreconditions once its query passed): answers there carry
// no entity tag, so no tag named matches, and "*" matches when the path has a representation
// (represented: a GET route serves it), as RFC 9110 (13.1.1, 13.1.2) says. A condition that
// fails is 412 (304 for a GET's If-None-Match: *) and the request is not performed: ignored,
// If-Match would let POST /v1/explain, :bulk or /v1/audit act on a condition that does not hold.
// A header that is not of the form is 400.
func conditional(h http.Handler, represented bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if untaggedPreconditions(w, r, represented) {
			h.ServeHTTP(w, r)
		}
	})
}

// untaggedPreconditions is preconditions for a route whose answers carry no entity tag
// (conditional; the list calls it once its query passed).
func untaggedPreconditions(w http.ResponseWriter, r *http.Request, represented bool) bool {
	failed := func() string {
		what := "no entity tag to match"
		if !represented {
			what = "no representation, so neither * nor an entity tag matches"
		}
		return fmt.Sprintf("If-Match %q: %s %s has %s; nothing was done (GET and DELETE /v1/counterfactuals/{id} evaluate "+
			"If-Match against the CE's ETag)", ident.Clip(strings.Join(r.Header.Values("If-Match"), ", "), maxQuoted), r.Method, r.URL.Path, what)
	}
	return preconditions(w, r, "", represented, true, failed)
}
