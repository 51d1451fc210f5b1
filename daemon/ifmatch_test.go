package daemon

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/ledger"
)

// TestParseIfMatch holds what an If-Match header may be (RFC 9110, 13.1.1): "*", or a list of
// entity tags, strong or weak, over one field or several, whose opaque part may hold commas and
// bytes past ASCII (obs-text); anything else is an error naming the header.
func TestParseIfMatch(t *testing.T) {
	long := strings.Repeat("!", 4*ceshare.MaxRIDLen)
	for _, c := range []struct {
		name   string
		fields []string
		want   *entityTags // nil with ok: no condition
		ok     bool
	}{
		{"no header", nil, nil, true},
		{"one tag", []string{`"0a1b"`}, &entityTags{strong: []string{"0a1b"}}, true},
		{"any", []string{"*"}, &entityTags{any: true}, true},
		{"a list", []string{`"a", W/"b" ,"c"`}, &entityTags{strong: []string{"a", "c"}, weak: []string{"b"}}, true},
		{"two fields", []string{`"a"`, `"b"`}, &entityTags{strong: []string{"a", "b"}}, true},
		{"empty elements", []string{` , "a",,`}, &entityTags{strong: []string{"a"}}, true},
		{"weak tags alone", []string{`W/"a"`, `W/"b"`}, &entityTags{weak: []string{"a", "b"}}, true},
		{"a comma inside a tag", []string{`"a,b", "c"`}, &entityTags{strong: []string{"a,b", "c"}}, true},
		{"obs-text", []string{`"clé"`, "\"\xff\""}, &entityTags{strong: []string{"clé", "\xff"}}, true},
		{"a long tag", []string{`"` + long + `"`}, &entityTags{strong: []string{long}}, true},
		{"the entity tag \"*\", not the wildcard", []string{`"*"`, `W/"*"`}, &entityTags{strong: []string{"*"}, weak: []string{"*"}}, true},
		{"an empty tag", []string{`""`, `W/""`}, &entityTags{strong: []string{""}, weak: []string{""}}, true},
		{"unquoted", []string{"0a1b"}, nil, false},
		{"empty", []string{""}, nil, false},
		{"only commas", []string{" , "}, nil, false},
		{"* beside a tag", []string{`*, "a"`}, nil, false},
		{"* in a field of its own, beside a tag", []string{`"a"`, "*"}, nil, false},
		{"* twice", []string{"*", "*"}, nil, false},
		{"* running on", []string{"*a"}, nil, false},
		{"a lone quote", []string{`"`}, nil, false},
		{"an unclosed tag after a tag", []string{`"a", "b`}, nil, false},
		{"a space inside", []string{`"a b"`}, nil, false},
		{"a control inside", []string{"\"a\x7f\""}, nil, false},
		{"a quote inside", []string{`"a"b"`}, nil, false},
		{"two tags without a comma", []string{`"a" "b"`}, nil, false},
		{"lower-case weak", []string{`w/"a"`}, nil, false},
		{"a megabyte unquoted", []string{strings.Repeat("x", 1<<20)}, nil, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := parseIfMatch(c.fields)
			switch {
			case c.ok && (err != nil || (got == nil) != (c.want == nil) ||
				got != nil && (got.any != c.want.any || !slices.Equal(got.strong, c.want.strong) || !slices.Equal(got.weak, c.want.weak))):
				t.Fatalf("parseIfMatch(%q) = %+v, %v; want %+v", c.fields, got, err, c.want)
			case !c.ok && (err == nil || got != nil):
				t.Fatalf("parseIfMatch(%q) = %+v, %v; want an error", c.fields, got, err)
			case !c.ok && !strings.Contains(err.Error(), "If-Match"):
				t.Fatalf("parseIfMatch(%q): %v does not name the header", c.fields, err)
			case !c.ok && len(err.Error()) > 1024:
				t.Fatalf("parseIfMatch of %d bytes: an error of %d bytes; want the header clipped", len(strings.Join(c.fields, "")), len(err.Error()))
			}
		})
	}
}

// TestDeletionTags holds the tags a conditional deletion passes on: "*" alone, or the distinct
// tags that can be a registration's, sorted (the same tags in another order are the same keyed
// request), or one that matches no registration when none can; every list fits a replica's
// request (ceshare.Request.IfMatch), and more than ceshare.MaxIfMatch registration tags is an
// error naming the header.
func TestDeletionTags(t *testing.T) {
	tag := func(i int) string { return fmt.Sprintf("%032x", i) }
	var many, quoted []string // in order, as tag sorts them
	for i := range ceshare.MaxIfMatch + 1 {
		many, quoted = append(many, tag(i)), append(quoted, `"`+tag(i)+`"`)
	}
	for _, c := range []struct {
		name   string
		fields []string
		want   []string // nil: an error
	}{
		{"any", []string{"*"}, []string{ledger.AnyTag}},
		{"sorted and distinct", []string{`"` + tag(2) + `", "` + tag(1) + `"`, `"` + tag(2) + `"`}, []string{tag(1), tag(2)}},
		{"no registration's tag", []string{`"a,b", W/"` + tag(1) + `", "` + strings.ToUpper(tag(10)) + `", "clé", "*"`}, []string{noTag}},
		{"a registration's tag beside others", []string{`"x", "` + tag(3) + `"`}, []string{tag(3)}},
		{"MaxIfMatch tags", []string{strings.Join(quoted[:ceshare.MaxIfMatch], ",")}, many[:ceshare.MaxIfMatch]},
		{"too many", []string{strings.Join(quoted, ",")}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			m, err := parseIfMatch(c.fields)
			if err != nil {
				t.Fatal(err)
			}
			got, err := m.ceTags()
			switch {
			case c.want == nil && (err == nil || !strings.Contains(err.Error(), "If-Match")):
				t.Fatalf("ceTags(%q) = %q, %v; want an error naming If-Match", c.fields, got, err)
			case c.want != nil && (err != nil || !slices.Equal(got, c.want)):
				t.Fatalf("ceTags(%q) = %q, %v; want %q", c.fields, got, err, c.want)
			}
			if _, _, err := ceshare.Encode(ceshare.Request{Kind: ceshare.KindDelete, ID: "ce-1", Replica: "r", At: time.Now(), IfMatch: got}); err != nil {
				t.Errorf("ceTags(%q) = %q, which a replica cannot send: %v", c.fields, got, err)
			}
		})
	}
}

// A DELETE with If-Match deletes a CE only while its id holds the registration the client read
// (its ETag, from the 201 or a GET): sent again after the CE was deleted and registered anew
// (even the same x, x_cf and target), it is 412 and the new registration stays, where a DELETE
// without it would delete that one. A keyed deletion with one If-Match and its key with another
// are two requests (422); "*" deletes whatever is stored; nothing stored is 404; a header that
// is no entity tag is 400.
func TestDeleteIfMatchKeepsARegistrationMadeSince(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	body := `{"id":"ce-1","x":` + mustJSON(t, data.X[xs[0]]) + `,"x_cf":` + mustJSON(t, data.X[cfs[0]]) + `,"target":"benign"}`
	register := func() string {
		t.Helper()
		resp, b := r.RawDo(t, "POST", "/v1/counterfactuals", body, nil)
		tag := resp.Header.Get("ETag")
		if resp.StatusCode != http.StatusCreated || !strings.HasPrefix(tag, `"`) {
			t.Fatalf("POST: %d %s, ETag %q; want 201 with an ETag", resp.StatusCode, b, tag)
		}
		if resp, _ := r.RawDo(t, "GET", "/v1/counterfactuals/ce-1", "", nil); resp.Header.Get("ETag") != tag {
			t.Fatalf("GET's ETag %q, the 201's %q: want one", resp.Header.Get("ETag"), tag)
		}
		return tag
	}
	del := func(header map[string]string, want int, says string) {
		t.Helper()
		resp, b := r.RawDo(t, "DELETE", "/v1/counterfactuals/ce-1", "", header)
		if resp.StatusCode != want || !strings.Contains(string(b), says) {
			t.Fatalf("DELETE with %q: %d %s; want %d saying %q", header, resp.StatusCode, b, want, says)
		}
	}
	first := register()
	del(map[string]string{"If-Match": `"00000000000000000000000000000000", W/` + first}, http.StatusPreconditionFailed, strings.Trim(first, `"`))
	del(map[string]string{"If-Match": first}, http.StatusNoContent, "")
	again := register()
	if again == first {
		t.Fatalf("the registration sent again has the first one's ETag %s", first)
	}
	// The first deletion sent again, with its If-Match: the registration made since stays.
	del(map[string]string{"If-Match": first}, http.StatusPreconditionFailed, strings.Trim(again, `"`))
	del(map[string]string{"If-Match": first, "Idempotency-Key": "k-1"}, http.StatusPreconditionFailed, "nothing was deleted")
	del(map[string]string{"If-Match": first, "Idempotency-Key": "k-1"}, http.StatusPreconditionFailed, "nothing was deleted")
	del(map[string]string{"Idempotency-Key": "k-1"}, http.StatusUnprocessableEntity, "another method, path, body or If-Match")
	if resp, _ := r.RawDo(t, "GET", "/v1/counterfactuals/ce-1", "", nil); resp.StatusCode != http.StatusOK || resp.Header.Get("ETag") != again {
		t.Fatalf("GET after the refused deletions: %d, ETag %q; want the registration made since, %s", resp.StatusCode, resp.Header.Get("ETag"), again)
	}
	// A keyed deletion's tags are a set: the same key with them in another order, or with a tag
	// beside them that names no registration, is the same request. A comma inside a tag is part
	// of it (RFC 9110's etagc).
	const unknown = `"00000000000000000000000000000000"`
	del(map[string]string{"If-Match": first + `, W/"x", ` + unknown, "Idempotency-Key": "k-2"}, http.StatusPreconditionFailed, "nothing was deleted")
	del(map[string]string{"If-Match": `"a,b", ` + unknown + ", " + first, "Idempotency-Key": "k-2"}, http.StatusPreconditionFailed, "nothing was deleted")
	del(map[string]string{"If-Match": `"a,b"`}, http.StatusPreconditionFailed, "nothing was deleted")
	del(map[string]string{"If-Match": "0a1b"}, http.StatusBadRequest, "If-Match")
	del(map[string]string{"If-Match": `"*"`}, http.StatusPreconditionFailed, "nothing was deleted") // an entity tag, not the wildcard
	del(map[string]string{"If-Match": "*"}, http.StatusNoContent, "")
	del(map[string]string{"If-Match": first}, http.StatusNotFound, "no counterfactual")
}

// A keyed registration's retry answers its own registration, never another: after its CE was
// deleted and the same CE registered again by another request (another ETag), the retry is 409
// naming that registration's ETag, not a 201 carrying it, whose If-Match would then delete the
// other request's CE.
func TestKeyedRetryDoesNotAnswerARegistrationMadeSince(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	body := `{"id":"ce-1","x":` + mustJSON(t, data.X[xs[0]]) + `,"x_cf":` + mustJSON(t, data.X[cfs[0]]) + `,"target":"benign"}`
	keyed := map[string]string{"Idempotency-Key": "k-1"}
	post := func(header map[string]string, want int) (string, string) {
		t.Helper()
		resp, b := r.RawDo(t, "POST", "/v1/counterfactuals", body, header)
		if resp.StatusCode != want {
			t.Fatalf("POST with %q: %d %s; want %d", header, resp.StatusCode, b, want)
		}
		return resp.Header.Get("ETag"), string(b)
	}
	first, _ := post(keyed, http.StatusCreated)
	if again, _ := post(keyed, http.StatusCreated); again != first {
		t.Fatalf("the keyed retry's ETag %s, the first answer's %s", again, first)
	}
	if resp, b := r.RawDo(t, "DELETE", "/v1/counterfactuals/ce-1", "", nil); resp.StatusCode != http.StatusNoContent {
		t.Fatalf("DELETE: %d %s", resp.StatusCode, b)
	}
	other, _ := post(nil, http.StatusCreated)
	if tag, msg := post(keyed, http.StatusConflict); tag != "" || !strings.Contains(msg, "registered again since") || !strings.Contains(msg, strings.Trim(other, `"`)) {
		t.Errorf("the keyed retry after the CE was registered again: ETag %q, %s; want 409 naming the registration made since, %s", tag, msg, other)
	}
}

// Every /v1/ route evaluates If-Match (RFC 9110, 13.1.1) rather than ignore it: a CE's GET
// against its ETag and the posterior's against its body's; a route whose answers carry no
// entity tag fails every tag (412, nothing done: a bulk line named is not stored), and "*" holds
// where the path has a representation (a GET route: POST /v1/counterfactuals registers) and
// fails where it has none (POST /v1/explain, :bulk). A header that is not "*" or entity tags is
// 400 everywhere. So for If-None-Match.
func TestEveryRouteEvaluatesIfMatch(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 2)
	ce := func(id string, k int) string {
		return `{"id":"` + id + `","x":` + mustJSON(t, data.X[xs[k]]) + `,"x_cf":` + mustJSON(t, data.X[cfs[k]]) + `,"target":"benign"}`
	}
	resp, b := r.RawDo(t, "POST", "/v1/counterfactuals", ce("ce-1", 0), nil)
	tag := resp.Header.Get("ETag")
	if resp.StatusCode != http.StatusCreated || tag == "" {
		t.Fatalf("POST: %d %s", resp.StatusCode, b)
	}
	resp, _ = r.RawDo(t, "GET", "/v1/model/posterior/sidecar", "", nil)
	sidecar := resp.Header.Get("ETag")
	const other = `"00000000000000000000000000000000"`
	for _, c := range []struct {
		method, path, body, ifMatch string
		want                        int
	}{
		{"GET", "/v1/counterfactuals/ce-1", "", tag, http.StatusOK},
		{"GET", "/v1/counterfactuals/ce-1", "", "*", http.StatusOK},
		{"GET", "/v1/counterfactuals/ce-1", "", other, http.StatusPreconditionFailed},
		{"GET", "/v1/counterfactuals/ce-1", "", "W/" + tag, http.StatusPreconditionFailed},
		{"GET", "/v1/counterfactuals/ce-1", "", `"a,b", ` + tag, http.StatusOK},
		{"GET", "/v1/counterfactuals/ce-1", "", "0a1b", http.StatusBadRequest},
		{"GET", "/v1/counterfactuals/none", "", tag, http.StatusNotFound},
		{"GET", "/v1/model/posterior/sidecar", "", sidecar, http.StatusOK},
		{"GET", "/v1/model/posterior/sidecar", "", other, http.StatusPreconditionFailed},
		{"GET", "/v1/model", "", "*", http.StatusOK},
		{"GET", "/v1/model", "", other, http.StatusPreconditionFailed},
		{"GET", "/v1/counterfactuals", "", other, http.StatusPreconditionFailed},
		{"POST", "/v1/counterfactuals:bulk", ce("bulk-1", 1), tag, http.StatusPreconditionFailed},
		{"POST", "/v1/counterfactuals:bulk", ce("bulk-1", 1), "*", http.StatusPreconditionFailed},
		{"POST", "/v1/explain", `{"x":` + mustJSON(t, data.X[xs[1]]) + `,"id":"explained"}`, "*", http.StatusPreconditionFailed},
		{"POST", "/v1/predict", `{"x":` + mustJSON(t, data.X[xs[1]]) + `}`, other, http.StatusPreconditionFailed},
		{"POST", "/v1/counterfactuals", ce("ce-2", 1), other, http.StatusPreconditionFailed},
		{"POST", "/v1/counterfactuals", ce("ce-2", 1), "0a1b", http.StatusBadRequest},
		{"POST", "/v1/counterfactuals", ce("ce-2", 1), "*", http.StatusCreated},
	} {
		resp, b := r.RawDo(t, c.method, c.path, c.body, map[string]string{"If-Match": c.ifMatch})
		if resp.StatusCode != c.want {
			t.Errorf("%s %s with If-Match %s: %d %s; want %d", c.method, c.path, c.ifMatch, resp.StatusCode, b, c.want)
		}
	}
	// If-None-Match (RFC 9110, 13.1.2) compares weakly; a CE's ETag names its registration, not
	// the answer (its status and bound change under it), so a GET naming it is answered in full;
	// "*" matches any path with a representation, so a GET is 304 with the ETag and no body and
	// another method 412 (nothing done); where the answers carry no entity tag no tag matches.
	// DELETE does not carry it to the CE's owner: 400, nothing deleted.
	for _, c := range []struct {
		method, path, body, ifNoneMatch string
		want                            int
	}{
		{"GET", "/v1/counterfactuals/ce-1", "", tag, http.StatusOK},
		{"GET", "/v1/counterfactuals/ce-1", "", `"x", W/` + tag, http.StatusOK},
		{"GET", "/v1/counterfactuals/ce-1", "", "*", http.StatusNotModified},
		{"GET", "/v1/counterfactuals/ce-1", "", other, http.StatusOK},
		{"GET", "/v1/counterfactuals/ce-1", "", "0a1b", http.StatusBadRequest},
		{"GET", "/v1/model", "", "*", http.StatusNotModified},
		{"GET", "/v1/model", "", tag, http.StatusOK},
		{"POST", "/v1/counterfactuals", ce("ce-3", 1), "*", http.StatusPreconditionFailed},
		{"POST", "/v1/explain", `{"x":` + mustJSON(t, data.X[xs[1]]) + `,"id":"explained"}`, "0a1b", http.StatusBadRequest},
		{"DELETE", "/v1/counterfactuals/ce-1", "", other, http.StatusBadRequest},
		{"DELETE", "/v1/counterfactuals/ce-1", "", "", http.StatusBadRequest}, // present, though empty
	} {
		resp, b := r.RawDo(t, c.method, c.path, c.body, map[string]string{"If-None-Match": c.ifNoneMatch})
		if resp.StatusCode != c.want {
			t.Errorf("%s %s with If-None-Match %s: %d %s; want %d", c.method, c.path, c.ifNoneMatch, resp.StatusCode, b, c.want)
		}
		if resp.StatusCode == http.StatusNotModified && (len(b) != 0 || c.path == "/v1/counterfactuals/ce-1" && resp.Header.Get("ETag") != tag) {
			t.Errorf("%s %s with If-None-Match %s: 304 with ETag %q and %d bytes; want the CE's ETag and no body",
				c.method, c.path, c.ifNoneMatch, resp.Header.Get("ETag"), len(b))
		}
	}
	if resp, _ := r.RawDo(t, "GET", "/v1/counterfactuals/ce-1", "", nil); resp.StatusCode != http.StatusOK {
		t.Errorf("ce-1 deleted by a DELETE with If-None-Match: GET %d", resp.StatusCode)
	}
	for _, id := range []string{"bulk-1", "explained", "ce-3"} {
		if resp, _ := r.RawDo(t, "GET", "/v1/counterfactuals/"+id, "", nil); resp.StatusCode != http.StatusNotFound {
			t.Errorf("%s stored by a request whose If-Match failed: GET %d", id, resp.StatusCode)
		}
	}
}
