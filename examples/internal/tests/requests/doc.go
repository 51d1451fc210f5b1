// Package requests runs examples/model_server.py on a small model and checks its answers: a
// single input gets scalar fields, malformed requests get 400 with a message naming what is
// wrong, and a directory without a model, or with a damaged sidecar, stops the server at start
// with the sidecar's path. Package examples checks
// that the server follows the posteriors cfguard exports.
package requests
