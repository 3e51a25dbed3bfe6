"""LWEPP, the lightweight endpoint picker: names the model-server endpoint for each request."""
