/* Embeds the built-in chat page (src/server/webui/index.html) into the library as the bytes
   atomc_webui_html .. atomc_webui_html_end (served by GET /, src/server/server.c). The path is
   relative to the repository root, where make runs; the Makefile lists the page as a dependency. */
    .section .rodata
    .global atomc_webui_html
    .global atomc_webui_html_end
    .balign 16
atomc_webui_html:
    .incbin "src/server/webui/index.html"
atomc_webui_html_end:
    .byte 0
    .section .note.GNU-stack,"",@progbits
