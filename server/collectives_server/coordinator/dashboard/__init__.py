"""The coordinator's web dashboard.

Modules:

* ``server``: the HTTP server and its page
* ``json_api``: the dashboard's JSON (one schema with ``collectives status --json``)
* ``limits``: an HTTP server that bounds its connections
* ``static/``: the page's HTML, CSS and JavaScript
"""
