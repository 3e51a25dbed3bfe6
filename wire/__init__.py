"""The ext_proc wire: Envoy's messages in and out, what one stream holds, and the one refusal."""
