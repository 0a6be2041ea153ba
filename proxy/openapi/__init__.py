"""The OpenAPI 3.1 document of the routes the proxy serves itself (`document`), one module
per dialect or route group, built from the shared schema blocks in `schema`."""
