package openapitest

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// TestValidatorCatchesMismatches: Validator rejects what the document does not describe.
func TestValidatorCatchesMismatches(t *testing.T) {
	v := Validator{T: t, Doc: Load(t)}
	ce := func(s string) any { return DecodeJSONNumbers(t, []byte(s)) }
	for _, c := range []struct {
		schema, body string
		ok           bool
	}{
		{"Error", `{"error":"x"}`, true},
		{"Error", `{"error":"x","extra":1}`, false},
		{"Error", `{}`, false},
		{"Status", `"at_risk"`, true},
		{"Status", `"fine"`, false},
		{"Target", `1`, true},
		{"Target", `"benign"`, true},
		{"Target", `1.5`, false},
		{"Anchor", `{"version":1,"refs":2,"kl":0.1,"kl_version":3,"created_at":"2026-01-02T03:04:05Z"}`, true},
		{"Anchor", `{"version":-1,"refs":2,"kl":0.1,"kl_version":3,"created_at":"2026-01-02T03:04:05Z"}`, false},
		{"Anchor", `{"version":1,"refs":2,"kl":0.1,"kl_version":3,"created_at":"yesterday"}`, false},
		{"CounterfactualPage", `{"counterfactuals":null,"next":""}`, true},
		{"CounterfactualPage", `{"counterfactuals":[{"id":"a"}],"next":""}`, false},
		{"PredictResponse", `{"posterior_version":0,"samples":10,"prediction":{"class":"a","index":0,"p":[1],"var":["x"]}}`, false},
	} {
		errs := v.Check(c.schema, map[string]any{"$ref": "#/components/schemas/" + c.schema}, ce(c.body))
		if (len(errs) == 0) != c.ok {
			t.Errorf("%s %s: errors %v, want ok %v", c.schema, c.body, errs, c.ok)
		}
	}
}

// recorder is a testing.TB that records the errors a check reports instead of failing.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *recorder) Error(args ...any) { r.errs = append(r.errs, fmt.Sprint(args...)) }

// canned answers every request with its status, headers and body.
type canned struct {
	status int
	header http.Header
	body   string
}

func (c canned) RawDo(t testing.TB, method, path, body string, header map[string]string) (*http.Response, []byte) {
	h := c.header.Clone()
	if h == nil {
		h = http.Header{}
	}
	h.Set("Content-Type", "application/json")
	return &http.Response{StatusCode: c.status, Header: h}, []byte(c.body)
}

// TestConformanceCatchesMismatches: an answer the document does not describe is reported: an
// undocumented status, a daemon header or Retry-After the operation does not list, a body that
// does not fit its schema; a documented answer is not.
func TestConformanceCatchesMismatches(t *testing.T) {
	doc := Load(t)
	for _, c := range []struct {
		name   string
		answer canned
		want   string // in the one error reported; "" for none
	}{
		{"documented", canned{200, nil, `{"status":"ok"}`}, ""},
		{"undocumented status", canned{418, nil, `{"status":"ok"}`}, "status not documented"},
		{"a daemon header not listed", canned{200, http.Header{"Cfguard-Something": {"1"}}, `{"status":"ok"}`}, "sends Cfguard-Something"},
		{"Retry-After not listed", canned{200, http.Header{"Retry-After": {"1"}}, `{"status":"ok"}`}, "sends Retry-After"},
		{"another header", canned{200, http.Header{"X-Other": {"1"}}, `{"status":"ok"}`}, ""},
		{"a body off its schema", canned{200, nil, `{"status":"ok","extra":1}`}, `property "extra" is not documented`},
	} {
		t.Run(c.name, func(t *testing.T) {
			rec := &recorder{TB: t}
			conf := New(rec, c.answer, doc)
			conf.SendTrailer("GET", "/healthz", "", nil, "", c.answer.status)
			switch {
			case c.want == "" && len(rec.errs) != 0:
				t.Errorf("errors %q, want none", rec.errs)
			case c.want != "" && (len(rec.errs) != 1 || !strings.Contains(rec.errs[0], c.want)):
				t.Errorf("errors %q, want one with %q", rec.errs, c.want)
			}
		})
	}
}
