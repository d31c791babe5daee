# Writes OUT, a C file that holds each file of FILES as a byte array named by the same position in
# NAMES (with NAME_len its size), followed by a 0 byte (so text is a C string): how moed-load carries
# its report page's scripts and style, and libmoedclient its link kernels' PTX.
#   cmake -DOUT=x.c -DNAMES="a|b" -DFILES="a.js|b.css" -P embed.cmake
# (lists separated by '|': a ';' would not survive the build tool's command line)
string(REPLACE "|" ";" NAMES "${NAMES}")
string(REPLACE "|" ";" FILES "${FILES}")
set(text "/* Written by client/c/load/html/embed.cmake from the files named below. */\n")
string(APPEND text "#include <stddef.h>\n")
foreach(name file IN ZIP_LISTS NAMES FILES)
    file(READ "${file}" hex HEX)
    string(LENGTH "${hex}" digits)
    math(EXPR bytes "${digits} / 2")
    # 32 bytes a line
    string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
    string(REGEX REPLACE "((0x..,){32})" "\\1\n" body "${body}")
    get_filename_component(base "${file}" NAME)
    string(APPEND text "\n/* ${base} */\nextern const unsigned char ${name}[];\n"
                       "extern const size_t ${name}_len;\n"
                       "const unsigned char ${name}[] = {\n${body}0};\n"
                       "const size_t ${name}_len = ${bytes};\n")
endforeach()
file(WRITE "${OUT}.tmp" "${text}")
file(RENAME "${OUT}.tmp" "${OUT}")
