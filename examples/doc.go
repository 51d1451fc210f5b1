// Package examples holds no Go API: it is the home of the Python examples of cfguard's
// boundaries with PyTorch, and of the Go tests that run them against cfguard.
//
//	export_torchbnn.py   trains a torchbnn-style BNN and exports its state_dict for `cfguard import`
//	                     (tested in cmd/cfguard/internal/tests/torchimport: the imported
//	                     model's predictive agrees with torch's)
//	model_server.py      serves a posterior cfguard exported (bnn.Save's directory) over HTTP and
//	                     follows it as new posterior versions are written (tested here, and its
//	                     answers to good and bad requests in examples/internal/tests/requests)
//
// Both need Debian's python3-torch and python3-numpy; without them the tests skip, unless
// CFGUARD_REQUIRE_TOOLS=1, which makes them fail.
package examples
