"""`actcache serve RUNS_DIR [--port P] [--host H]`: the explorers under a folder over local HTTP."""

from __future__ import annotations

from actcache.serve import make_server, page_urls


def cmd_serve(args) -> int:
    server = make_server(args.runs_dir, args.host, args.port)
    with server:
        urls = page_urls(args.runs_dir, server)
        for url in urls:
            print(url, flush=True)
        if not urls:
            print(
                f"no explorer under {args.runs_dir} yet (run `actcache visuals`); serving its files anyway", flush=True
            )
        print("serving read-only until Ctrl-C", flush=True)
        server.serve_forever()
    return 0
