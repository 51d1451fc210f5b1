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

// parseIfMatch reads the If-Match header fields of a request (RFC 9110, 13.1.1: "*", or a list
// of entity tags): nil when there is none; ledger.AnyTag for "*"; else each tag's opaque
// content, a weak tag kept with its W/ so that it matches nothing (If-Match compares strongly),
// and the entity tags "*" and "" kept quoted, so that the first is not the wildcard and the
// second not empty. A field that is not of that form (* beside entity tags is not), or names more than ceshare.MaxIfMatch tags, or tags outside printable ASCII or
// over ceshare.MaxRIDLen bytes as passed on (W/ included), is an error naming it: every list it
// answers is one a replica can send (ceshare.Request.IfMatch).
func parseIfMatch(fields []string) ([]string, error) {
	if len(fields) == 0 {
		return nil, nil
	}
	bad := func(why string) error {
		return fmt.Errorf("If-Match %q: %s; send \"*\" or the ETag of GET /v1/counterfactuals/{id}, quoted", strings.Join(fields, ", "), why)
	}
	var tags []string
	for _, f := range fields {
		for _, el := range strings.Split(f, ",") {
			el = strings.Trim(el, " \t")
			switch {
			case el == "":
				continue // the list rule allows empty elements
			case el == "*":
				tags = append(tags, ledger.AnyTag)
				continue
			}
			weak := strings.HasPrefix(el, "W/")
			opaque := strings.TrimPrefix(el, "W/")
			if len(opaque) < 2 || opaque[0] != '"' || opaque[len(opaque)-1] != '"' {
				return nil, bad(fmt.Sprintf("%q is not an entity tag", el))
			}
			opaque = opaque[1 : len(opaque)-1]
			tag := opaque
			switch {
			case weak:
				tag = "W/" + opaque
			case opaque == ledger.AnyTag, opaque == "":
				// The entity tag "*", which is not the wildcard *, and the empty one: kept quoted,
				// they match nothing (a request's tag is not empty).
				tag = `"` + opaque + `"`
			}
			// The bound is the request's (ceshare.Request.IfMatch), which a replica sends the tags in.
			if len(tag) > ceshare.MaxRIDLen || strings.ContainsFunc(opaque, func(r rune) bool { return r < 0x21 || r > 0x7e || r == '"' }) {
				return nil, bad(fmt.Sprintf("%q: a tag is at most %d printable ASCII characters (%d for a weak one), without quotes inside",
					el, ceshare.MaxRIDLen, ceshare.MaxRIDLen-len("W/")))
			}
			tags = append(tags, tag)
		}
	}
	switch {
	case len(tags) == 0:
		return nil, bad("no entity tag")
	case len(tags) > 1 && slices.Contains(tags, ledger.AnyTag): // If-Match = "*" / #entity-tag
		return nil, bad("* stands alone, without entity tags beside it")
	case len(tags) > ceshare.MaxIfMatch:
		return nil, bad(fmt.Sprintf("%d entity tags, over %d", len(tags), ceshare.MaxIfMatch))
	}
	return tags, nil
}

// ifMatchHolds evaluates a request's If-Match header fields (parseIfMatch; ok when there is
// none) against a representation: tag its entity tag without quotes ("" for none), exists
// whether the target has one. "*" holds when it exists; a list, when it names tag (strongly: a
// weak tag never matches). err is parseIfMatch's, for a header that is not of that form.
func ifMatchHolds(fields []string, tag string, exists bool) (ok bool, err error) {
	tags, err := parseIfMatch(fields)
	if err != nil || tags == nil {
		return err == nil, err
	}
	if slices.Contains(tags, ledger.AnyTag) {
		return exists, nil
	}
	return exists && tag != "" && slices.Contains(tags, tag), nil
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
