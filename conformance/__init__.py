"""GIE's conformance tests run locally: a real Envoy, Switchyard's LWEPP, echo servers."""
